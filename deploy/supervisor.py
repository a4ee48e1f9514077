"""Graceful drain: the supervisor ``kvrelay serve`` runs around a prefill or decode vLLM server.

Contract
--------
* :func:`supervise` starts the vLLM command as a child in the supervisor's own process
  group (a SIGKILL of the group still takes everything down) and returns its exit status.
* **SIGTERM to the supervisor** (what Kubernetes sends a pod's PID 1) drains the node:

  1. the drain file says DRAINING (:mod:`kvrelay.core.drain`): the engine's ``/health`` answers
     503, so routers and readiness probes take the node out; a decode node keeps
     admitting requests with pull params (the loads already aimed at it), a prefill node
     admits nothing new; the requests, loads and pushes in flight go on;
  2. once the engine has had no running or waiting request and no KV block in use for
     ``engine.drain_quiet_s`` (read from its own ``/metrics``), or ``engine.drain_timeout_s``
     has passed, the file says STOPPING and vLLM gets SIGTERM; vLLM's own
     ``--shutdown-timeout`` (``engine.drain_timeout_s``) lets anything still running finish
     (the supervisor waits for the time left, plus 30 s, then kills it); from STOPPING on, a
     decode node's receiver refuses new transfers (no write may be in flight when it exits);
  3. the supervisor exits with vLLM's status and removes the drain file.

* SIGINT (Ctrl-C; a terminal sends it to the whole group) is passed on to vLLM, which stops
  at once; a second SIGTERM does the same.
* **What vLLM leaves behind is removed** (:class:`Scratch`): vLLM binds its processes' ZeroMQ
  sockets as files under ``VLLM_RPC_BASE_PATH`` and does not remove them when it stops (seven
  per server in vLLM 0.32, by any signal), nor a socket it binds for KV events. The node's
  scratch directory is made empty and private before vLLM starts and removed, with the files
  named, once vLLM has exited - cleanly or not. Only a SIGKILL of the supervisor itself leaves
  them, and the next start of the node clears its directory.
* The clock and the idle probe are constructor arguments (tests drive them without a server).
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.drain import DrainPhase, write_phase

log = logging.getLogger("kvrelay.drain")
BUSY_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def engine_busy(metrics_url: str, timeout: float = 3.0) -> bool:
    """True when the engine's ``/metrics`` at ``metrics_url`` shows a request running or waiting
    or KV in use (an engine that does not answer counts as busy)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return True
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in BUSY_SERIES) > 0


@dataclass(frozen=True)
class DrainPlan:
    drain_file: str
    timeout_s: float             # the whole drain, SIGTERM to exit
    quiet_s: float               # idle this long = drained
    poll_s: float = 0.5


@dataclass(frozen=True)
class Scratch:
    """A node's leftovers: ``dirs`` are made empty and private (0700) before vLLM starts and
    removed after it exits; ``files`` (some written for vLLM before it starts, such as its
    logging config) are removed after it exits. Missing paths are no error."""

    dirs: tuple[Path, ...] = ()
    files: tuple[Path, ...] = ()

    def prepare(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)        # what a killed supervisor left
            d.mkdir(mode=0o700)

    def remove(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        for f in self.files:
            f.unlink(missing_ok=True)


class Supervisor:
    """One vLLM server and its drain (see the module docstring)."""

    def __init__(self, cmd: list[str], env: dict[str, str], plan: DrainPlan, busy: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic, scratch: Scratch = Scratch()) -> None:
        self.cmd, self.env, self.plan, self.busy, self.clock = cmd, env, plan, busy, clock
        self.scratch = scratch
        self.term = threading.Event()
        self.stop_now = threading.Event()
        self.child: subprocess.Popen | None = None

    def on_sigterm(self, *_: object) -> None:
        if self.term.is_set():
            self.stop_now.set()
        self.term.set()

    def on_sigint(self, *_: object) -> None:
        self.stop_now.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGINT)

    def run(self) -> int:
        write_phase(self.plan.drain_file, DrainPhase.SERVING)          # a stale file from a crash
        self.scratch.prepare()
        self.child = subprocess.Popen(self.cmd, env=self.env)
        try:
            while self.child.poll() is None and not self.term.is_set():
                self.term.wait(0.5)
            if self.child.poll() is None:
                self.drain(self.child)
            return self.child.wait()
        finally:
            write_phase(self.plan.drain_file, DrainPhase.SERVING)
            if self.child.poll() is not None:
                self.scratch.remove()

    def drain(self, child: subprocess.Popen) -> None:
        plan, t0 = self.plan, self.clock()
        log.info("kvrelay: SIGTERM - draining (at most %.0f s; stops after %.0f s idle)", plan.timeout_s, plan.quiet_s)
        write_phase(plan.drain_file, DrainPhase.DRAINING)
        idle_since: float | None = None
        while child.poll() is None and not self.stop_now.is_set():
            now = self.clock()
            if now - t0 >= plan.timeout_s:
                log.warning("kvrelay: drain timeout (%.0f s) reached with work in flight; stopping", plan.timeout_s)
                break
            if self.busy():
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= plan.quiet_s:
                log.info("kvrelay: drained in %.1f s; stopping vLLM", now - t0)
                break
            self.stop_now.wait(plan.poll_s)
        write_phase(plan.drain_file, DrainPhase.STOPPING)
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)     # vLLM finishes what still runs within --shutdown-timeout
            try:
                child.wait(max(1.0, plan.timeout_s - (self.clock() - t0)) + 30)
            except subprocess.TimeoutExpired:
                log.error("kvrelay: vLLM did not stop; killing it")
                child.kill()


def supervise(cmd: list[str], env: dict[str, str], metrics_url: str, plan: DrainPlan,
              scratch: Scratch = Scratch()) -> int:
    """Run ``cmd`` under a :class:`Supervisor` with the signal handlers installed; its exit status."""
    sup = Supervisor(cmd, env, plan, lambda: engine_busy(metrics_url), scratch=scratch)
    signal.signal(signal.SIGTERM, sup.on_sigterm)
    signal.signal(signal.SIGINT, sup.on_sigint)
    return sup.run()
