"""Ceilings for ``kvrelay bench transfer``, measured in the same run as the backends.

Each raw path moves the same sizes between two processes with the least code
possible, so a kvrelay backend can be judged as a ratio against it:

* ``memcpy``  - single-thread numpy copy inside one process (the hardware ceiling).
* ``raw_shm`` - child copies into a shared segment, notifies over a Unix socket.
* ``raw_tcp`` - child ``sendall``s on a loopback TCP socket; parent ``recv_into``s.
* ``raw_nixl``- two NIXL agents (UCX, no progress thread): WRITE + notification.

Protocol for the two-process paths: the parent (sink) records when each chunk is
complete; the child (source) records when it started writing it. Both use
``time.monotonic()``, which is system-wide on Linux, so one-way latency is
``arrival - start``. Chunks go in batches of ``window``.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import threading
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from transport.polling import Backoff

NOTE = struct.Struct("<Q")


SOURCE_BYTES = 256 << 20


def source(size: int, seed: int) -> np.ndarray:
    """A source of >= SOURCE_BYTES viewed as ``[n, size]``: chunk i is row ``i % n``, so
    consecutive chunks stream from DRAM instead of re-reading a cache-hot buffer."""
    n = max(2, SOURCE_BYTES // size)
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def memcpy(size: int, count: int, window: int = 1) -> tuple[list[float], list[float]]:
    src = source(size, 0)
    dst = np.empty((window, size), dtype=np.uint8)
    starts, arrivals = [], []
    for i in range(count):
        t0 = time.monotonic()
        np.copyto(dst[i % window], src[i % len(src)])
        arrivals.append(time.monotonic())
        starts.append(t0)
    return starts, arrivals


# ----------------------------------------------------------------------------- child side
def _child(kind: str, conn: Any, size: int, count: int, window: int, info: Any) -> None:
    src = source(size, 1)
    starts: list[float] = []
    if kind == "raw_tcp":
        s = socket.create_connection(info)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send("ready")
        conn.recv()
        for i in range(count):
            starts.append(time.monotonic())
            s.sendall(src[i % len(src)])
            if i % window == window - 1 or i == count - 1:
                conn.recv()                  # parent saw the batch: closed loop
        conn.recv()
        s.close()
    elif kind == "raw_shm":
        name, addr = info
        shm = shared_memory.SharedMemory(name=name)
        dst = np.ndarray((window, size), dtype=np.uint8, buffer=shm.buf)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(addr)
        conn.send("ready")
        conn.recv()
        for i in range(count):
            starts.append(time.monotonic())
            np.copyto(dst[i % window], src[i % len(src)])
            s.sendall(NOTE.pack(i))
            if i % window == window - 1 or i == count - 1:
                conn.recv()                  # parent saw the batch: closed loop
        conn.recv()
        del dst
        s.close()
        shm.close()
    else:
        starts = _nixl_child(conn, src, count, window, info)
    conn.send(starts)


def _nixl_child(conn: Any, src: np.ndarray, count: int, window: int, info: Any) -> list[float]:
    from transport.backends.nixl import make_agent

    agent = make_agent("raw-src", "none")
    agent.register_memory([(int(src.ctypes.data), src.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(info["meta"])
    conn.send(agent.get_agent_metadata())
    conn.recv()
    size = src.shape[1]
    starts = []
    for b in range(0, count, window):
        handles = []
        for i in range(b, min(b + window, count)):
            row = src[i % len(src)]
            local = agent.get_xfer_descs([(int(row.ctypes.data), size, 0)], "DRAM")
            rd = agent.get_xfer_descs([(info["base"] + (i % window) * size, size, 0)], "DRAM")
            starts.append(time.monotonic())
            h = agent.initialize_xfer("WRITE", local, rd, remote, str(i).encode())
            agent.transfer(h)
            handles.append(h)
        backoff = Backoff(30)
        while handles and backoff.wait():
            handles = [h for h in handles if agent.check_xfer_state(h) == "PROC"]
        conn.recv()                          # parent saw the batch
    conn.recv()
    return starts


# ----------------------------------------------------------------------------- parent side
def two_process(kind: str, size: int, count: int, window: int) -> tuple[list[float], list[float]]:
    """Run one raw path; return (starts, arrivals) for ``count`` chunks."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    arrivals: list[float] = []
    setup, run, teardown = _PARENTS[kind](size, window, arrivals)
    proc = ctx.Process(target=_child, args=(kind, child_conn, size, count, window, setup()), daemon=True)
    proc.start()
    try:
        run(conn, count)
        starts = conn.recv()
    finally:
        proc.join(30)
        teardown()
    return starts, arrivals


def _tcp_parent(size: int, window: int, arrivals: list[float]) -> tuple:
    lsock = socket.create_server(("127.0.0.1", 0))
    buf = memoryview(bytearray(size))

    def run(conn: Any, count: int) -> None:
        c, _ = lsock.accept()
        conn.recv()
        conn.send("go")
        for i in range(count):
            got = 0
            while got < size:
                got += c.recv_into(buf[got:])
            arrivals.append(time.monotonic())
            if i % window == window - 1 or i == count - 1:
                conn.send("next")
        conn.send("done")
        c.close()

    return (lambda: ("127.0.0.1", lsock.getsockname()[1])), run, lsock.close


def _shm_parent(size: int, window: int, arrivals: list[float]) -> tuple:
    shm = shared_memory.SharedMemory(create=True, size=size * window)
    addr = f"\0kvrelay-raw-{id(shm):x}"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(addr)
    lsock.listen(1)

    def run(conn: Any, count: int) -> None:
        c, _ = lsock.accept()
        conn.recv()
        conn.send("go")
        note = bytearray(NOTE.size)
        for i in range(count):
            c.recv_into(note, NOTE.size, socket.MSG_WAITALL)
            arrivals.append(time.monotonic())
            if i % window == window - 1 or i == count - 1:
                conn.send("next")
        conn.send("done")
        c.close()

    def teardown() -> None:
        lsock.close()
        shm.close()
        shm.unlink()

    return (lambda: (shm.name, addr)), run, teardown


def _nixl_parent(size: int, window: int, arrivals: list[float]) -> tuple:
    from transport.backends.nixl import make_agent

    agent = make_agent("raw-sink", "none")
    dst = np.zeros(size * window, dtype=np.uint8)
    agent.register_memory([(int(dst.ctypes.data), dst.nbytes, 0, "")], "DRAM")

    def run(conn: Any, count: int) -> None:
        agent.add_remote_agent(conn.recv())
        conn.send("go")
        seen = 0
        backoff = Backoff(60)
        while seen < count and backoff.wait():
            notifs = agent.get_new_notifs()
            now = time.monotonic()
            n = sum(len(v) for v in notifs.values())
            if n:
                backoff.reset()
                arrivals.extend([now] * n)
                prev, seen = seen, seen + n
                batches = -(-seen // window) if seen == count else seen // window
                for _ in range(batches - prev // window):
                    conn.send("next")
        conn.send("done")

    info = {"meta": agent.get_agent_metadata(), "base": int(dst.ctypes.data)}
    return (lambda: info), run, (lambda: threading.Thread(target=lambda: dst).start())


_PARENTS = {"raw_tcp": _tcp_parent, "raw_shm": _shm_parent, "raw_nixl": _nixl_parent}
RAW_KINDS = tuple(_PARENTS)
