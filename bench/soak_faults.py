"""The soak's faults: what each does to a running stack, and when.

A fault is injected and then repaired (:meth:`Injector.inject`, blocking: run it off the
event loop); the :class:`Injection` it returns says when each happened, on the injected
clock, so the report can count the requests in flight at the injection and time the
recovery. The stack is 1P and 3D (decode2 held back: the capacity a ``decode added`` fault
brings, which a ``decode drained`` fault takes away again):

* ``decode SIGKILL``, ``prefill SIGKILL``: the node's whole process group, then a restart;
* ``prefill drain``: SIGTERM to ``kvrelay serve`` (as Kubernetes stops a pod), then a restart;
* ``decode added`` / ``decode drained``: decode2 started / drained;
* ``Redis stopped``: the store's Redis tier killed, started again empty after ``hold_s``;
* ``store disk full``: the disk tier's filesystem (a small tmpfs) filled for ``hold_s``;
* ``P-D link cut``: needs the multi-host namespaces; on one loopback it is reported as not run.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench.local_redis import RedisServer
from kvrelay.deploy import launch


class FaultKind(str, enum.Enum):
    DECODE_KILL = "decode SIGKILL"
    PREFILL_KILL = "prefill SIGKILL"
    PREFILL_DRAIN = "prefill drain"
    DECODE_ADDED = "decode added"
    DECODE_DRAINED = "decode drained"
    REDIS_STOPPED = "Redis stopped"
    DISK_FULL = "store disk full"
    LINK_CUT = "P-D link cut"


CYCLE = (FaultKind.DECODE_KILL, FaultKind.REDIS_STOPPED, FaultKind.DECODE_ADDED, FaultKind.PREFILL_DRAIN,
         FaultKind.DISK_FULL, FaultKind.DECODE_DRAINED, FaultKind.PREFILL_KILL)
QUICK = (FaultKind.DECODE_KILL, FaultKind.REDIS_STOPPED, FaultKind.PREFILL_DRAIN)   # the CI variant's
HELD = "decode2"                 # the decode node a "decode added" fault starts


@dataclass(frozen=True)
class Injection:
    kind: FaultKind
    at: float                    # injected (clock)
    repaired: float              # the node healthy again / the tier back (clock); == at if never broken
    detail: str = ""
    skipped: str = ""            # why it was not run (then at == repaired)


def schedule(duration_s: float, warmup_s: float, every_s: float,
             kinds: tuple[FaultKind, ...]) -> list[tuple[float, FaultKind]]:
    """(offset from the start of traffic, fault), ``kinds`` in turn: the first after the warm-up,
    one every ``every_s``, none in the last ``every_s`` (the stack settles before the end)."""
    out: list[tuple[float, FaultKind]] = []
    t = warmup_s
    while t <= duration_s - every_s:
        out.append((t, kinds[len(out) % len(kinds)]))
        t += every_s
    return out


@dataclass
class Injector:
    """Injects one fault at a time into ``stack`` (and its Redis tier and disk-tier mount)."""

    stack: launch.Stack
    redis: RedisServer | None
    disk: Path | None                  # the disk tier's directory, on a filesystem of its own
    hold_s: float = 20.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def inject(self, kind: FaultKind) -> Injection:
        how = {FaultKind.DECODE_KILL: lambda: self._kill(FaultKind.DECODE_KILL, "decode0"),
               FaultKind.PREFILL_KILL: lambda: self._kill(FaultKind.PREFILL_KILL, "prefill0"),
               FaultKind.PREFILL_DRAIN: self._drain_prefill,
               FaultKind.DECODE_ADDED: self._add_decode,
               FaultKind.DECODE_DRAINED: self._drain_decode,
               FaultKind.REDIS_STOPPED: self._redis,
               FaultKind.DISK_FULL: self._fill_disk,
               FaultKind.LINK_CUT: self._link}[kind]
        return how()

    def _kill(self, kind: FaultKind, node: str) -> Injection:
        at = self.clock()
        self.stack.kill(node)
        self.stack.restart(node)
        return Injection(kind, at, self.clock(), f"{node} SIGKILLed and restarted")

    def _drain_prefill(self) -> Injection:
        at = self.clock()
        code = self.stack.drain("prefill0")
        self.stack.restart("prefill0")
        return Injection(FaultKind.PREFILL_DRAIN, at, self.clock(), f"prefill0 drained (exit {code}), restarted")

    def _add_decode(self) -> Injection:
        at = self.clock()
        if HELD in self.stack.procs:
            return Injection(FaultKind.DECODE_ADDED, at, at, skipped=f"{HELD} already running")
        self.stack.restart(HELD)
        return Injection(FaultKind.DECODE_ADDED, at, self.clock(), f"{HELD} started")

    def _drain_decode(self) -> Injection:
        at = self.clock()
        if HELD not in self.stack.procs:
            return Injection(FaultKind.DECODE_DRAINED, at, at, skipped=f"{HELD} not running")
        code = self.stack.drain(HELD)
        return Injection(FaultKind.DECODE_DRAINED, at, self.clock(), f"{HELD} drained (exit {code})")

    def _redis(self) -> Injection:
        at = self.clock()
        if self.redis is None:
            return Injection(FaultKind.REDIS_STOPPED, at, at, skipped="no Redis tier (redis-server not installed)")
        self.redis.stop()
        self.sleep(self.hold_s)
        self.redis.start()
        return Injection(FaultKind.REDIS_STOPPED, at, self.clock(), f"killed, started again empty after {self.hold_s:g} s")

    def _fill_disk(self) -> Injection:
        at = self.clock()
        if self.disk is None:
            return Injection(FaultKind.DISK_FULL, at, at, skipped="the disk tier is not on a filesystem of its own "
                             "(mounting a tmpfs needs root)")
        filler = self.disk / "soak-filler"
        written = fill(filler)
        self.sleep(self.hold_s)
        filler.unlink()
        return Injection(FaultKind.DISK_FULL, at, self.clock(), f"{written >> 20} MiB filler held {self.hold_s:g} s")

    def _link(self) -> Injection:
        at = self.clock()
        return Injection(FaultKind.LINK_CUT, at, at, skipped="needs P and D in network namespaces of their own "
                         "(tests/multihost); this stack shares one loopback")


def fill(path: Path, block: int = 1 << 20) -> int:
    """Write ``path`` until its filesystem is full; the bytes written."""
    written, zeros = 0, bytes(block)
    with open(path, "wb") as f:
        while True:
            try:
                f.write(zeros)
                f.flush()
                written += block
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return written


@contextlib.contextmanager
def small_filesystem(path: Path, size_mib: int) -> Iterator[Path | None]:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` (root only); yields the path, or None
    where it cannot be mounted (the disk fault is then reported as not run)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        yield None
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
