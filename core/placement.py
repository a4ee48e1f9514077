"""CPU placement of the connectors' helper threads (push, install, store lookup).

Never pins an engine thread: only the calling helper thread's affinity changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def _allowed_cpus() -> set[int]:
    """Every CPU this container/cgroup may use (not just the calling thread's pinned set)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def place_helper_thread(policy: str) -> None:
    """Set the calling helper thread's CPU affinity (``connector.helper_cpus``).

    vLLM's CPU worker pins its forward thread (and so every thread it creates) to the
    cores it computes on; a push/install thread that inherits that pin time-slices with
    the model instead of using an idle core. ``all`` lets the helper run on any CPU the
    container allows, ``inherit`` keeps the engine's pin, anything else is a CPU list
    like ``"2-3"``. Only the helper thread is affected - never the engine's threads.
    """
    if policy == "inherit" or not hasattr(os, "sched_setaffinity"):
        return
    if policy == "all":
        cpus = _allowed_cpus()
    else:
        cpus = set()
        for part in policy.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    try:
        os.sched_setaffinity(0, cpus)             # 0 = the calling thread on Linux
    except OSError as exc:
        logging.getLogger("vllm.kvrelay").warning("helper_cpus=%r not applied: %s", policy, exc)
