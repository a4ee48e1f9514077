"""UCX backend through ``ucxx`` (the maintained successor of ucx-py): tag send/receive.

For hosts that have UCX but not NIXL. The receiver posts, for every granted
slot, two tagged receives straight into the slot - the 128-byte header and the
payload - and reports the chunk when both complete. The sender connects to the
receiver's worker address (no listener: worker-address endpoints get CMA and
shared memory on one host, RDMA across hosts) and posts two tagged sends. A
payload made of several regions is gathered once into a staging buffer on the
sender (UCX tag messages are contiguous); ``nixl`` is the zero-copy path.

Tag layout (64 bits): ``slot << 40 | (generation & 0xffffffff) << 8 | part``.

Progress is driven from our own threads with :class:`kvrelay.common.polling.Backoff`;
ucxx's progress thread is not used (its polling mode busy-polls a core).
Importing ucxx writes ``UCX_*`` variables into ``os.environ`` (some tuned for
CUDA); :func:`_import_ucxx` restores the environment so they do not leak into
NIXL in the same process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrelay.common.errors import HandshakeError, TransportError
from kvrelay.common.polling import IDLE_AFTER_S, IDLE_SLEEP_S, Backoff, progress_loop
from kvrelay.common.wire import HEADER_SIZE, transfer_tag
from kvrelay.transport.backends.base import (
    Payload,
    ReceiverBackend,
    ReceiverHooks,
    SenderBackend,
    WriteHandle,
    WriteState,
    host_buffers,
)
from kvrelay.transport.pool import ReceivePool, SlotRef
from kvrelay.transport.protocol import Grant

log = logging.getLogger(__name__)
_UCXX: Any = None
_IMPORT_LOCK = threading.Lock()


def _import_ucxx() -> Any:
    """ucxx's modules, imported once. Locked: lane threads create their senders at the same
    time, and a thread that saved the environment while another was importing would restore
    ucxx's CUDA-tuned ``UCX_*`` variables for good."""
    global _UCXX
    if _UCXX is not None:                      # every post and write asks: no lock once imported
        return _UCXX
    with _IMPORT_LOCK:
        if _UCXX is None:
            _UCXX = _import_restoring_environ()
    return _UCXX


def _import_restoring_environ() -> Any:
    saved = dict(os.environ)
    try:
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise TransportError("ucxx is not installed: pip install ucxx-cu12") from exc
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return libucxx, Array


def ucx_tag(ref: SlotRef | Grant, part: int, token: bytes) -> int:
    """The 64-bit UCX tag of one part of a chunk write: keyed by the transfer's grant token, so
    a send that does not know the token matches no posted receive and never lands in a slot."""
    slot = ref.index if isinstance(ref, SlotRef) else ref.slot
    body = struct.pack("<IQB", slot, ref.generation, part)
    return int.from_bytes(hashlib.blake2b(body, key=token, digest_size=8).digest(), "little")


def _worker() -> tuple[Any, Any]:
    lib, _ = _import_ucxx()
    try:
        ctx = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
        return ctx, lib.UCXWorker(ctx)
    except Exception as exc:  # noqa: BLE001 - ucxx raises its own UCXError family
        raise TransportError(f"cannot create a UCX worker: {exc}") from exc


class UcxReceiver(ReceiverBackend):
    def __init__(self) -> None:
        self._ctx, self.worker = _worker()
        self._lock = threading.Lock()
        # (transfer_id) -> list of [sender, chunk, ref, header_req, payload_req]
        self._posted: dict[str, list[list[Any]]] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pool: ReceivePool, hooks: ReceiverHooks) -> None:
        self._pool, self._hooks = pool, hooks
        self._base: Any = np.frombuffer(pool.view(0, pool.num_slots * pool.slot_bytes), dtype=np.uint8)
        self._thread = threading.Thread(target=self._poll_loop, name="kvrelay-ucx-rx", daemon=True)
        self._thread.start()

    def info(self) -> bytes:
        return bytes(self.worker.address.tobytes())

    def _post(self, sender: str, chunk: int, ref: SlotRef, token: bytes) -> list[Any]:
        lib, Array = _import_ucxx()
        off = self._pool.offset(ref)
        hdr = self._base[off:off + HEADER_SIZE]
        body = self._base[off + HEADER_SIZE:off + self._pool.slot_bytes]
        return [sender, chunk, ref, token, self.worker.tag_recv(Array(hdr), lib.UCXXTag(ucx_tag(ref, 0, token))),
                self.worker.tag_recv(Array(body), lib.UCXXTag(ucx_tag(ref, 1, token)))]

    def on_grants(self, sender_id: str, transfer_id: str, grants: Sequence[tuple[int, SlotRef]],
                  token: bytes) -> None:
        with self._lock:
            posted = [self._post(sender_id, chunk, ref, token) for chunk, ref in grants]
            self._posted.setdefault(transfer_id, []).extend(posted)
        self._wake.set()

    def on_release(self, sender_id: str, transfer_id: str) -> None:
        with self._lock:
            dropped = self._posted.pop(transfer_id, [])
            if not any(not (e[4].completed and e[5].completed) for e in dropped):
                return
            # UCX cannot cancel one request: cancel all, then re-post the ones still wanted,
            # so a late send can never land in a slot that has been reassigned.
            self.worker.cancel_inflight_requests()
            for tid, entries in self._posted.items():
                self._posted[tid] = [self._post(s, c, r, k) if not (h.completed and p.completed)
                                     else [s, c, r, k, h, p] for s, c, r, k, h, p in entries]

    def _poll_loop(self) -> None:
        progress_loop(self._closed, self._wake, lambda: bool(self._posted), self._progress,
                      Backoff(spin=50, max_sleep=100e-6, idle_after=IDLE_AFTER_S, idle_sleep=IDLE_SLEEP_S))

    def _progress(self) -> bool:
        """One progress pass: complete chunks are delivered, failed ones reported."""
        with self._lock:
            self.worker.progress()
            done, failed = self._collect()
        for sender, chunk, ref, token, tid in done:
            self._hooks.deliver(sender, transfer_tag(tid), chunk, ref, token)
        for sender, chunk, ref, tid, reason in failed:
            self._hooks.chunk_failed(sender, transfer_tag(tid), chunk, ref, reason)
        return bool(done)

    def _collect(self) -> tuple[list[tuple[str, int, SlotRef, bytes, str]], list[tuple[str, int, SlotRef, str, str]]]:
        done: list[tuple[str, int, SlotRef, bytes, str]] = []
        failed: list[tuple[str, int, SlotRef, str, str]] = []
        for tid, entries in self._posted.items():
            keep = []
            for e in entries:
                sender, chunk, ref, token, hreq, preq = e
                if hreq.completed and preq.completed:
                    try:
                        hreq.check_error()
                        preq.check_error()
                        done.append((sender, chunk, ref, token, tid))
                    except Exception as exc:  # noqa: BLE001 - UCXError family: fail the chunk now
                        failed.append((sender, chunk, ref, tid, f"UCX receive failed: {exc}"))
                else:
                    keep.append(e)
            self._posted[tid] = keep
        return done, failed

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock, contextlib.suppress(Exception):
            self.worker.cancel_inflight_requests()
        self._posted.clear()
        self._base = None


class UcxSender(SenderBackend):
    def __init__(self) -> None:
        self._ctx, self.worker = _worker()
        self.ep: Any = None
        self.staged_bytes = 0
        self._abandoned: list[Any] = []       # cancelled sends: buffers kept alive until UCX completes them

    def connect(self, sender_id: str, receiver_info: bytes, slot_bytes: int, data_token: bytes) -> None:
        lib, _ = _import_ucxx()
        try:
            addr = lib.UCXAddress.create_from_buffer(receiver_info)
            self.ep = lib.UCXEndpoint.create_from_worker_address(self.worker, addr, False)
        except Exception as exc:  # noqa: BLE001 - UCXError family
            raise HandshakeError(f"cannot connect a UCX endpoint to the receiver: {exc}") from exc

    def write(self, transfer_id: str, chunk_index: int, header: bytes, payload: Payload,
              grant: Grant) -> WriteHandle:
        lib, Array = _import_ucxx()
        regions = host_buffers(payload)
        if len(regions) == 1:
            body = np.frombuffer(regions[0], dtype=np.uint8)
        else:
            body = np.concatenate([np.frombuffer(r, dtype=np.uint8) for r in regions])
            self.staged_bytes += body.nbytes
        hdr = np.frombuffer(header, dtype=np.uint8)
        handle = WriteHandle(transfer_id, chunk_index, grant, HEADER_SIZE + body.nbytes)
        try:
            reqs = (self.ep.tag_send(Array(hdr), lib.UCXXTag(ucx_tag(grant, 0, grant.token))),
                    self.ep.tag_send(Array(body), lib.UCXXTag(ucx_tag(grant, 1, grant.token))))
        except Exception as exc:  # noqa: BLE001 - UCXError family
            raise TransportError(f"UCX send of chunk {chunk_index} failed: {exc}") from exc
        handle.native = (reqs, hdr, body)      # keep the buffers alive until completion
        return handle

    def cancel(self, handle: WriteHandle) -> None:
        if handle.state is WriteState.POSTED and handle.native is not None:
            self._abandoned.append(handle.native)
        self._abandoned = [n for n in self._abandoned if not all(r.completed for r in n[0])]
        super().cancel(handle)

    def poll(self, handle: WriteHandle) -> WriteState:
        if handle.state is WriteState.POSTED:
            self.worker.progress()
            reqs = handle.native[0]  # type: ignore[index]
            if all(r.completed for r in reqs):
                try:
                    for r in reqs:
                        r.check_error()
                    handle.state = WriteState.DONE
                except Exception as exc:  # noqa: BLE001 - UCXError family
                    handle.state, handle.error = WriteState.FAILED, str(exc)
                handle.native = None
        return handle.state

    def close(self) -> None:
        if self.ep is not None:
            with contextlib.suppress(Exception):
                self.ep.close_blocking()
            self.ep = None
