"""Plain vLLM references on every core share: servers bound as a stack's engines, asked at once.

A reference (for the soak, the differential harness and the tests) is plain vLLM bound as
each engine of the stack it checks, since CPU numerics change with the OpenMP thread count:
on a 2-core host, one core. One such server leaves the other core idle for the whole
reference run. :func:`servers` starts one server per share instead - server k of the stack's n,
bound exactly as engine k is (``launch.server_env``) - so every server computes with the same
thread count as every engine, and :func:`spread` asks them all at once.

Which server answers a request does not change its answer: the servers differ only in which
core their one thread runs on.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvrelay.common.private_files import RPC_BASE_ENV
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch

T = TypeVar("T")
R = TypeVar("R")


def server_count(of: int, tp: int = 1) -> int:
    """How many servers run at once: one per core share of a stack of ``of`` servers, as long as
    each of its ``tp`` ranks has a core of its own (never two ranks on one core)."""
    return max(1, min(of, len(os.sched_getaffinity(0)) // tp))


@dataclass(frozen=True)
class Servers:
    """Running plain vLLM servers: their URLs and process groups."""

    urls: list[str]
    procs: list[subprocess.Popen]

    def pause(self) -> None:
        """SIGSTOP every server's process group: kept, memory and all, at no CPU (an idle vLLM's
        worker polls its queue: ~3 % of a core each)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


@contextlib.contextmanager
def servers(cfg: kcfg.KVRelayConfig, port: int, log_dir: Path, *, of: int = 2, tp: int = 1,
            startup_s: float = 900) -> Iterator[Servers]:
    """Plain vLLM servers with ``tp`` ranks on ports ``port``, ``port + 1``, ...: server k bound
    as engine k of a stack of ``of`` servers. Stops every one on exit (paused ones too)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    ipc = tempfile.TemporaryDirectory(prefix="kvrelay-ref-")   # vLLM's local sockets, removed at the end
    try:
        for k in range(server_count(of, tp)):
            logs.append(log_dir / f"reference{k}-tp{tp}.log")
            spec = launch.NodeSpec(launch.Role.SINGLE, 0, port + k, tp=tp)
            env = {**launch.server_env(cfg, k, of, tp), RPC_BASE_ENV: ipc.name}
            with open(logs[-1], "w") as log:
                procs.append(launch.spawn_group(launch.server_command(cfg, spec), env, log))
        urls = [f"http://127.0.0.1:{port + k}" for k in range(len(procs))]
        for url, proc, log_path in zip(urls, procs, logs, strict=True):
            launch.wait_healthy(url, proc, startup_s, str(log_path))
        yield Servers(urls, procs)
    finally:
        Servers([], procs).resume()               # a stopped process cannot act on SIGINT
        launch.stop_groups(procs)
        ipc.cleanup()


def spread(urls: Sequence[str], items: Sequence[T], ask: Callable[[str, T], R], per_server: int = 1) -> list[R]:
    """``ask(url, item)`` for every item, ``per_server`` at a time on each server (whichever is
    free takes the next item); the answers in the items' order. The first error is raised."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(items)):
        todo.put(i)
    out: dict[int, R] = {}
    errors: list[BaseException] = []

    def worker(url: str) -> None:
        while not errors:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = ask(url, items[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(url,), daemon=True) for url in urls for _ in range(per_server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [out[i] for i in range(len(items))]
