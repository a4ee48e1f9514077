"""Ceilings for ``kvrelay bench transfer``, measured in the same run as the backends.

Each raw path moves the same chunks between two processes with the least code
possible, so a kvrelay backend can be judged as a ratio against it:

* ``memcpy``   - single-thread numpy copy inside one process (the hardware ceiling).
* ``raw_shm``  - child copies into a shared segment, notifies over a Unix socket.
* ``raw_tcp``  - child ``sendall``s on a loopback TCP socket; parent ``recv_into``s.
* ``raw_nixl`` - two NIXL agents (UCX, no progress thread): WRITE + notification.

Every path reads chunk ``i`` from row ``i`` of a 256 MiB source (streaming from
DRAM, as a paged KV cache does) into one of ``window`` destination slots.
Chunks go in closed-loop batches of ``window``. The parent (sink) records when
each chunk is complete, the child (source) when it started writing it; both use
``time.monotonic()``, which is system-wide on Linux. Paths stay up across
measurements (:class:`RawPath`), so repeated, interleaved measurements are cheap.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import struct
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from kvrelay.common.polling import Backoff

SOURCE_BYTES = 256 << 20
NOTE = struct.Struct("<Q")
RAW_KINDS = ("raw_shm", "raw_tcp", "raw_nixl")


def source(size: int, seed: int) -> np.ndarray:
    """``[n, size]`` rows over >= SOURCE_BYTES: chunk i is row ``i % n``."""
    n = max(2, SOURCE_BYTES // size)
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def copy_out(view: Any, scratch: np.ndarray) -> None:
    """The consumer's work on one chunk, the same on every path: one copy out of where it landed
    (what an install does; kvrelay's consumer also verifies the checksum in that pass)."""
    src = np.frombuffer(view, dtype=np.uint8)
    np.copyto(scratch[:src.size], src)


class Memcpy:
    """The single-thread memcpy ceiling, same access pattern as the two-process paths: the copy
    into the slot, then the consumer's copy out of it."""

    def __init__(self) -> None:
        self._src: np.ndarray | None = None

    def measure(self, size: int, window: int, count: int) -> tuple[list[float], list[float]]:
        if self._src is None or self._src.shape[1] != size:
            self._src = source(size, 0)
        src, dst = self._src, np.empty((window, size), dtype=np.uint8)
        scratch = np.empty(size, dtype=np.uint8)
        starts, arrivals = [], []
        for i in range(count):
            t0 = time.monotonic()
            np.copyto(dst[i % window], src[i % len(src)])
            copy_out(dst[i % window], scratch)
            arrivals.append(time.monotonic())
            starts.append(t0)
        return starts, arrivals

    def close(self) -> None:
        self._src = None


# ----------------------------------------------------------------------------- child side
class _Source:
    def __init__(self, kind: str, conn: Any, info: Any) -> None:
        self.kind, self.conn, self.info = kind, conn, info
        self.src: np.ndarray | None = None
        if kind == "raw_tcp":
            self.sock = socket.create_connection(info)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif kind == "raw_shm":
            self.shm = shared_memory.SharedMemory(name=info[0])
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(info[1])
        else:
            from kvrelay.transport.backends.nixl import make_agent

            self.agent = make_agent(f"raw-src-{os.getpid()}", "none")
            self.remote = self.agent.add_remote_agent(info["meta"])
            conn.send(self.agent.get_agent_metadata())
            self.reg = None

    def prepare(self, size: int) -> None:
        if self.src is not None and self.src.shape[1] == size:
            return
        if self.kind == "raw_nixl" and self.reg is not None:
            self.agent.deregister_memory(self.reg)
        self.src = source(size, 1)
        if self.kind == "raw_nixl":
            self.reg = self.agent.register_memory([(int(self.src.ctypes.data), self.src.nbytes, 0, "")], "DRAM")

    def run(self, size: int, window: int, count: int) -> list[float]:
        self.prepare(size)
        starts: list[float] = []
        for b in range(0, count, window):
            n = min(window, count - b)
            if self.kind == "raw_nixl":
                self._nixl_batch(b, n, window, size, starts)
            else:
                for i in range(b, b + n):
                    self._send(i, window, size, starts)
            self.conn.recv()                     # parent saw the batch: closed loop
        return starts

    def _send(self, i: int, window: int, size: int, starts: list[float]) -> None:
        assert self.src is not None
        row = self.src[i % len(self.src)]
        starts.append(time.monotonic())
        if self.kind == "raw_tcp":
            self.sock.sendall(row)
        else:
            dst = np.ndarray((size,), dtype=np.uint8, buffer=self.shm.buf, offset=(i % window) * size)
            np.copyto(dst, row)
            del dst
            self.sock.sendall(NOTE.pack(i))

    def _nixl_batch(self, b: int, n: int, window: int, size: int, starts: list[float]) -> None:
        assert self.src is not None
        handles = []
        for i in range(b, b + n):
            row = self.src[i % len(self.src)]
            local = self.agent.get_xfer_descs([(int(row.ctypes.data), size, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(self.info["base"] + (i % window) * size, size, 0)], "DRAM")
            starts.append(time.monotonic())
            h = self.agent.initialize_xfer("WRITE", local, remote, self.remote, str(i).encode())
            self.agent.transfer(h)
            handles.append(h)
        backoff = Backoff(30)
        while handles and backoff.wait():
            handles = [h for h in handles if self.agent.check_xfer_state(h) == "PROC"]


def _child(kind: str, conn: Any, info: Any) -> None:
    src = _Source(kind, conn, info)
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            return
        if cmd == "close":
            return
        conn.send(src.run(*args))


# ----------------------------------------------------------------------------- parent side
class RawPath:
    """A sink here and a source child, kept up across measurements."""

    def __init__(self, kind: str, max_size: int, max_window: int) -> None:
        self.kind = kind
        cap = max_size * max_window
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        if kind == "raw_tcp":
            self._lsock = socket.create_server(("127.0.0.1", 0))
            info: Any = ("127.0.0.1", self._lsock.getsockname()[1])
            self._buf = memoryview(bytearray(max_size))
        elif kind == "raw_shm":
            self._shm = shared_memory.SharedMemory(create=True, size=cap)
            addr = f"\0kvrelay-raw-{os.getpid()}-{id(self):x}"
            self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._lsock.bind(addr)
            self._lsock.listen(1)
            info = (self._shm.name, addr)
        else:
            from kvrelay.transport.backends.nixl import make_agent

            self.agent = make_agent(f"raw-sink-{os.getpid()}", "none")
            self._dst = np.zeros(cap, dtype=np.uint8)
            self.agent.register_memory([(int(self._dst.ctypes.data), cap, 0, "")], "DRAM")
            info = {"meta": self.agent.get_agent_metadata(), "base": int(self._dst.ctypes.data)}
        self._scratch = np.empty(max_size, dtype=np.uint8)
        self.proc = ctx.Process(target=_child, args=(kind, child_conn, info), daemon=True)
        self.proc.start()
        if kind == "raw_nixl":
            self.agent.add_remote_agent(self.conn.recv())
        else:
            self._c, _ = self._lsock.accept()

    def measure(self, size: int, window: int, count: int) -> tuple[list[float], list[float]]:
        arrivals: list[float] = []
        self.conn.send(("run", (size, window, count)))
        for b in range(0, count, window):
            n = min(window, count - b)
            if self.kind == "raw_nixl":
                self._nixl_wait(n, arrivals, size, window)
            else:
                for _ in range(n):
                    self._recv_one(size, window, arrivals)
            self.conn.send(("next", ()))
        starts: list[float] = self.conn.recv()
        return starts, arrivals

    def _recv_one(self, size: int, window: int, arrivals: list[float]) -> None:
        if self.kind == "raw_tcp":
            got, buf = 0, self._buf[:size]
            while got < size:
                got += self._c.recv_into(buf[got:])
            copy_out(buf, self._scratch)
        else:
            note = bytearray(NOTE.size)
            self._c.recv_into(note, NOTE.size, socket.MSG_WAITALL)
            (i,) = NOTE.unpack(note)
            off = (i % window) * size
            shm_buf = self._shm.buf
            assert shm_buf is not None
            copy_out(shm_buf[off:off + size], self._scratch)
        arrivals.append(time.monotonic())

    def _nixl_wait(self, n: int, arrivals: list[float], size: int, window: int) -> None:
        seen = 0
        backoff = Backoff(60)
        while seen < n and backoff.wait():
            notifs = self.agent.get_new_notifs()
            for msgs in notifs.values():
                for msg in msgs:
                    off = (int(msg) % window) * size
                    copy_out(self._dst[off:off + size], self._scratch)
                    arrivals.append(time.monotonic())
                    seen += 1
                    backoff.reset()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("close", ()))
        self.proc.join(10)
        if self.kind != "raw_nixl":
            self._c.close()
            self._lsock.close()
        if self.kind == "raw_shm":
            self._shm.close()
            self._shm.unlink()
