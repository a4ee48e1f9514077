"""How `kvrelay up` and the benchmarks start servers: one process group each, one session for all.

Real processes: a child shell that spawns a grandchild, as vLLM's API server spawns its
engine core and workers.
"""

from __future__ import annotations

import os
import sys
import time

from kvrelay.deploy import launch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:          # a zombie still answers kill(0)
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_server_leads_its_own_group_in_the_callers_session_and_stops_with_its_children(tmp_path):
    # SIGINT's default action, as vLLM's and kvrelay's servers install it: a child of a
    # non-interactive shell's background job inherits SIGINT ignored, and would sit out the grace
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)")
    with open(tmp_path / "child.log", "wb") as log:
        proc = launch.spawn_group([sys.executable, "-c", code], dict(os.environ), log)
    deadline = time.monotonic() + 20
    while not (tmp_path / "child.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int((tmp_path / "child.log").read_text().split()[0])
    try:
        assert os.getpgid(proc.pid) == proc.pid                      # killpg reaches the whole tree
        assert os.getpgid(grandchild) == proc.pid
        # the same session as the caller: with kernel.sched_autogroup_enabled, one scheduling group
        assert os.getsid(proc.pid) == os.getsid(0) != proc.pid
    finally:
        launch.stop_group(proc, grace_s=5)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_server_does_not_read_the_callers_terminal(tmp_path):
    with open(tmp_path / "c.log", "wb") as log:
        proc = launch.spawn_group([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], dict(os.environ), log)
    assert proc.wait(20) == 0
    assert (tmp_path / "c.log").read_text().strip() == "''"
