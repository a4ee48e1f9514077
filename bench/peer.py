"""A :class:`~kvrelay.transport.sender.Sender` in a child process, driven by commands over a pipe.

The conformance suite and ``kvrelay bench transfer`` use it so sender and
receiver always run in separate processes (separate address spaces, real
sockets, real NIXL/UCX endpoints), the way prefill and decode nodes do.
Source buffers live in the child and are registered with the backend once,
like a paged KV cache; digests are computed from those source bytes, not from
anything the transport produced.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

from kvrelay.common.errors import KVRelayError, TransportError
from kvrelay.core.config import KVRelayConfig, from_dict, to_dict


class RemoteError(TransportError):
    """The child raised; ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class SenderPeer:
    def __init__(self, cfg: KVRelayConfig, endpoint: str, fingerprint: bytes,
                 sender_id: str | None = None, secret: bytes | None = None) -> None:
        """``secret``: the shared secret to use (default: the one the child's environment names)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, to_dict(cfg), endpoint, fingerprint, sender_id, secret),
                                daemon=True, name="kvrelay-sender-peer")
        self.proc.start()
        child.close()

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TransportError(f"sender peer did not answer {cmd!r} within {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RemoteError(*value)
        return value

    def signal(self) -> None:
        """Release a child blocked between batches in ``stream`` (closed-loop gating)."""
        self._conn.send(("__next__", ()))

    def kill(self) -> None:
        """SIGKILL the child: a sender dying mid-transfer."""
        self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=10)
            except (TransportError, EOFError, OSError):
                self.proc.kill()
            self.proc.join(10)
        self._conn.close()

    def __enter__(self) -> SenderPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Child:
    def __init__(self, cfg: KVRelayConfig, endpoint: str, fingerprint: bytes, sender_id: str | None,
                 conn: Any = None, secret: bytes | None = None) -> None:
        import numpy as np

        self.conn = conn
        from kvrelay.transport.backends import make_sender_backend
        from kvrelay.transport.sender import Sender

        self.np = np
        self.backend = make_sender_backend(cfg.transport)
        self.sender = Sender(cfg.transport, cfg.timeouts, endpoint, self.backend, fingerprint, sender_id=sender_id,
                             secret=secret)
        self.sources: dict[str, Any] = {}
        self.retired: list[Any] = []
        self.allocs: dict[str, Any] = {}
        self.block_bytes: dict[str, int] = {}

    def connect(self) -> str:
        self.sender.connect()
        return self.sender.sender_id

    def prepare(self, name: str, nbytes: int, seed: int, block_bytes: int = 0) -> None:
        """A random source buffer. A ``registered_layout`` backend gets it registered as a KV
        layout of ``block_bytes`` blocks (default: one block), like a paged KV cache."""
        from kvrelay.transport.backends.base import MemRegion, SourceLayout

        buf = self.np.random.default_rng(seed).integers(0, 256, nbytes, dtype=self.np.uint8)
        if name in self.sources:                  # registered memory must outlive its registration
            self.retired.append(self.sources[name])
        self.sources[name] = buf
        self.block_bytes[name] = block_bytes or nbytes
        if self.backend.capabilities.registered_layout:
            region = MemRegion(int(buf.ctypes.data), nbytes)
            self.sender.register_layout(SourceLayout((region,), self.block_bytes[name]))

    def _blocks(self, name: str, offset: int, nbytes: int) -> Any:
        """The bytes as a BlockPayload of the registered layout when the backend takes one."""
        from kvrelay.transport.backends.base import BlockPayload

        bb = self.block_bytes[name]
        if not self.backend.capabilities.registered_layout or offset % bb or nbytes % bb:
            return None
        return BlockPayload(tuple(range(offset // bb, (offset + nbytes) // bb)))

    def digest(self, name: str, offset: int, nbytes: int) -> str:
        return hashlib.sha256(memoryview(self.sources[name])[offset:offset + nbytes]).hexdigest()

    def alloc(self, tid: str, keys: list[bytes], sizes: list[int], wait_s: float | None = None) -> dict:
        a = self.sender.alloc(tid, keys, sizes, wait_s)
        self.allocs[tid] = a
        return {"grants": sorted(a.grants), "held": a.held}

    def give_up_alloc(self, tid: str, keys: list[bytes], sizes: list[int], wait_s: float) -> bool:
        """Send an Alloc, then give up on it as a failing push does (``Sender.abandon``) without
        reading any later reply. True if D had answered it before the give-up."""
        pending = self.sender.alloc_async(tid, keys, sizes, wait_s)
        answered = self.sender.poll_alloc(pending) is not None
        self.sender.abandon(pending)
        return answered

    def _regions(self, name: str, offset: int, nbytes: int, regions: int) -> list[memoryview]:
        mv = memoryview(self.sources[name])[offset:offset + nbytes]
        step = -(-nbytes // regions)
        return [mv[i:i + step] for i in range(0, nbytes, step)]

    def write(self, tid: str, idx: int, name: str, offset: int, nbytes: int, regions: int = 1,
              corrupt: bool = False, wait: bool = True, blocks: bool = False) -> float:
        """Write source bytes as chunk ``idx``: as ``regions`` buffers, or (``blocks``) as named
        blocks of the registered layout where the backend can."""
        from kvrelay.common.wire import make_header

        alloc = self.allocs[tid]
        regs = self._regions(name, offset, nbytes, regions)
        header = make_header(alloc.keys[idx], tid, idx, regs).pack()
        if corrupt:                                   # fault injection: flip a byte after checksumming
            src = self.sources[name]
            src[offset + nbytes // 2] ^= 0xFF
        t0 = time.monotonic()
        payload = (self._blocks(name, offset, nbytes) if blocks else None) or regs
        h = self.sender.write_chunk(alloc, idx, payload, header=header)
        if wait and h is not None:
            self.sender.wait(h)
        if corrupt:
            self.sources[name][offset + nbytes // 2] ^= 0xFF
        return t0

    def stream(self, tid: str, name: str, nbytes: int, count: int, window: int) -> list[float]:
        """Push ``count`` chunks of ``nbytes`` in batches of ``window``; return each write's start.

        Chunk ``i`` is read from offset ``i * nbytes`` of the source (wrapping), so a source
        larger than the caches streams from DRAM like a paged KV cache does. All headers
        (checksums) are built before the first write. Between batches the child waits for
        :meth:`SenderPeer.signal` (closed loop): every batch starts from an idle pipe.
        """
        from kvrelay.common.wire import HEADER_SIZE, make_header

        src = memoryview(self.sources[name])
        slots = max(1, src.nbytes // nbytes)
        named = self.block_bytes.get(name) == nbytes and self.backend.capabilities.registered_layout
        plan = []
        for b in range(0, count, window):
            btid = f"{tid}.{b}"
            n = min(window, count - b)
            keys = [hashlib.sha256(f"{btid}/{i}".encode()).digest() for i in range(n)]
            regs = [[src[((b + i) % slots) * nbytes:][:nbytes]] for i in range(n)]
            headers = [make_header(keys[i], btid, i, regs[i]).pack() for i in range(n)]
            payloads = [self._blocks(name, ((b + i) % slots) * nbytes, nbytes) for i in range(n)] if named else regs
            plan.append((btid, keys, payloads, headers))
        starts: list[float] = []
        for k, (btid, keys, regs, headers) in enumerate(plan):
            alloc = self.sender.alloc(btid, keys, [HEADER_SIZE + nbytes] * len(keys))
            handles = []
            for i in range(len(keys)):
                starts.append(time.monotonic())
                handles.append(self.sender.write_chunk(alloc, i, regs[i], header=headers[i]))
            for h in handles:
                if h is not None:
                    self.sender.wait(h)
            if k + 1 < len(plan) and self.conn is not None:
                self.conn.recv()                      # the parent consumed the batch
        return starts

    def abort(self, tid: str, reason: str = "test abort") -> None:
        self.sender.abort(tid, reason)

    def close(self) -> None:
        self.sender.close()


def _orphan_watchdog(parent: int) -> None:
    """Exit when the parent dies (SIGKILLed test runners must not leave senders behind)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def _main(conn: Any, cfg_data: dict, endpoint: str, fingerprint: bytes, sender_id: str | None,
          secret: bytes | None = None) -> None:
    import threading

    threading.Thread(target=_orphan_watchdog, args=(os.getppid(),), daemon=True).start()
    try:
        child = _Child(from_dict(cfg_data), endpoint, fingerprint, sender_id, conn, secret)
    except Exception as exc:  # noqa: BLE001 - report any start-up failure to the parent
        conn.recv()
        conn.send((False, (type(exc).__name__, str(exc))))
        return
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            result = getattr(child, cmd)(*args)
            conn.send((True, result))
        except (KVRelayError, ValueError, KeyError, OSError) as exc:
            conn.send((False, (type(exc).__name__, f"{exc}\n{traceback.format_exc(limit=3)}")))
        if cmd == "close":
            break
    conn.close()
    os._exit(0)
