"""NIXL backend (UCX underneath): one-sided WRITEs straight into the decode node's pool.

* The receiver registers the whole pool once (DRAM here; the pool is pinned on
  CUDA hosts) and ships its agent metadata in ``HelloAck.info``.
* The sender registers its long-lived sources once (:meth:`NixlSender.register_source`,
  e.g. the paged KV cache; DRAM or VRAM) and posts each chunk's payload as a
  descriptor list ``[region_0, region_1, ...]`` against consecutive ranges of the
  remote slot after its header - no sender-side copy. A region outside
  registered memory is registered for the duration of that write.
* The 128-byte chunk header does not travel as data: it rides in the WRITE's
  notification (``NOTIF``: slot, generation, chunk index, then the header),
  which NIXL delivers only after the payload is complete. The receiver's poller
  writes the header into the slot and reports the arrival. One descriptor less
  per chunk, and no header staging memory on the sender.

Per FACTS.md: agents are created with the progress thread off and ``backends=[]``,
the UCX backend with the same ``ucx_error_handling_mode`` on both sides, and
completions / notifications are polled from our own threads with an adaptive
backoff (:class:`transport.polling.Backoff`) - never a busy-polling progress thread
pinning a core. The receiver only polls while it has slots granted.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from transport.backends.base import (
    Buffer,
    DeliverFn,
    PeerLostFn,
    ReceiverBackend,
    SenderBackend,
    WriteHandle,
    WriteState,
)
from transport.errors import HandshakeError, TransportError
from transport.polling import Backoff
from transport.pool import ReceivePool, SlotRef
from transport.protocol import Grant
from transport.wire import HEADER_SIZE

log = logging.getLogger(__name__)
NOTIF = struct.Struct("<4sIIQ")          # magic, chunk index, slot, generation; then the header
NOTIF_MAGIC = b"KVRN"
CONSUMER_GRACE_S = 2e-3     # background polling backs off while a consumer polled this recently


@dataclass(frozen=True)
class DeviceRegion:
    """A region in device memory (or any raw address) that cannot be a Python buffer."""

    address: int
    nbytes: int
    device: int = 0
    mem_type: str = "VRAM"


class NixlInfo(msgspec.Struct, frozen=True):
    agent: str
    metadata: bytes
    base: int                 # address of the receiver's pool


def _import_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise TransportError("NIXL is not installed: pip install nixl-cu12 and (--no-deps) nixl; "
                             "see README 'Install'") from exc
    return nixl_agent, nixl_agent_config


def make_agent(name: str, error_mode: str) -> Any:
    """A NIXL agent with no progress thread and a UCX backend in ``error_mode``."""
    nixl_agent, nixl_agent_config = _import_nixl()
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode})
    except Exception as exc:  # noqa: BLE001 - nixl raises bare RuntimeError/nixlError types
        raise TransportError(f"cannot create NIXL agent with UCX backend: {exc}") from exc
    return agent


def buffer_address(buf: Buffer) -> tuple[int, int]:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data), int(arr.nbytes)


class NixlReceiver(ReceiverBackend):
    def __init__(self, *, error_mode: str = "none", name: str | None = None) -> None:
        self.error_mode = error_mode
        self.name = name or f"kvrelay-recv-{uuid.uuid4().hex[:8]}"
        self.agent = make_agent(self.name, error_mode)
        self._active = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._reg: Any = None
        self._poll_lock = threading.Lock()
        self._consumer_polled = 0.0

    poll_driven = True

    def start(self, pool: ReceivePool, deliver: DeliverFn, peer_lost: PeerLostFn) -> None:
        self._pool, self._deliver = pool, deliver
        self._base = pool.arena.address
        self._reg = self.agent.register_memory([(self._base, pool.arena.buf.nbytes, 0, "")], "DRAM")
        self._thread = threading.Thread(target=self._poll_loop, name="kvrelay-nixl-rx", daemon=True)
        self._thread.start()

    def info(self) -> bytes:
        return msgspec.msgpack.encode(NixlInfo(self.name, self.agent.get_agent_metadata(), self._base))

    def on_hello(self, sender_id: str, info: bytes) -> None:
        try:
            meta = msgspec.msgpack.decode(info, type=NixlInfo)
            self.agent.add_remote_agent(meta.metadata)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(f"bad NIXL hello info: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            raise HandshakeError(f"NIXL could not load the sender's metadata: {exc}") from exc

    def on_grants(self, sender_id: str, transfer_id: str, grants: Sequence[tuple[int, SlotRef]]) -> None:
        with self._lock:
            self._active += 1
        self._wake.set()

    def on_release(self, sender_id: str, transfer_id: str) -> None:
        with self._lock:
            self._active = max(0, self._active - 1)

    def progress(self) -> int:
        self._consumer_polled = time.monotonic()
        return self._drain()

    def _drain(self) -> int:
        if not self._poll_lock.acquire(blocking=False):
            return 0                                  # another thread is draining right now
        try:
            notifs = self.agent.get_new_notifs()
            n = 0
            for agent_name, msgs in notifs.items():
                for raw in msgs:
                    self._on_notif(agent_name, raw)
                    n += 1
            return n
        finally:
            self._poll_lock.release()

    def _poll_loop(self) -> None:
        """Background progress while transfers are active and no consumer is polling."""
        backoff = Backoff(spin=0, max_sleep=100e-6)
        while not self._closed.is_set():
            if self._active == 0 and not self._wake.wait(0.05):
                continue
            self._wake.clear()
            if time.monotonic() - self._consumer_polled < CONSUMER_GRACE_S:
                time.sleep(CONSUMER_GRACE_S)          # a consumer is driving progress
                continue
            if self._drain():
                backoff.reset()
            else:
                backoff.wait()

    def _on_notif(self, agent_name: str, raw: bytes) -> None:
        if len(raw) != NOTIF.size + HEADER_SIZE or raw[:4] != NOTIF_MAGIC:
            log.warning("ignored malformed NIXL notification (%d bytes) from %s", len(raw), agent_name)
            return
        _, chunk_index, slot, gen = NOTIF.unpack_from(raw)
        ref = SlotRef(slot, gen)
        header = raw[NOTIF.size:]
        try:
            self._pool.begin_write(ref)         # the slot must still be leased to this chunk
        except TransportError:
            self._deliver(agent_name, header[40:56], chunk_index, ref)   # counted as stale
            return
        try:
            self._pool.view(ref, HEADER_SIZE)[:] = header
        finally:
            self._pool.end_write(ref)
        self._deliver(agent_name, header[40:56], chunk_index, ref)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._reg is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._reg)
            self._reg = None


class NixlSender(SenderBackend):
    def __init__(self, *, error_mode: str = "none") -> None:
        self.error_mode = error_mode
        self.agent: Any = None
        self._ranges: list[tuple[int, int]] = []   # registered (start, end), sorted
        self._regs: list[Any] = []
        self._remote = ""
        self._remote_base = 0
        self.dynamic_registrations = 0

    def _ensure_agent(self, name: str) -> None:
        if self.agent is None:
            self.agent = make_agent(name, self.error_mode)

    def local_info(self, sender_id: str) -> bytes:
        self._ensure_agent(sender_id)          # agent name == sender id: notifications name us
        return msgspec.msgpack.encode(NixlInfo(sender_id, self.agent.get_agent_metadata(), 0))

    def _register(self, addr: int, nbytes: int, mem_type: str = "DRAM", device: int = 0) -> Any:
        reg = self.agent.register_memory([(addr, nbytes, device, "")], mem_type)
        self._regs.append(reg)
        bisect.insort(self._ranges, (addr, addr + nbytes))
        return reg

    def register_source(self, buf: Buffer | DeviceRegion) -> None:
        if self.agent is None:
            raise TransportError("register_source before the NIXL agent exists (call after connect)")
        if isinstance(buf, DeviceRegion):
            self._register(buf.address, buf.nbytes, buf.mem_type, buf.device)
        else:
            self._register(*buffer_address(buf))

    def connect(self, sender_id: str, receiver_info: bytes, slot_bytes: int) -> None:
        try:
            info = msgspec.msgpack.decode(receiver_info, type=NixlInfo)
            self._remote = self.agent.add_remote_agent(info.metadata)
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            raise HandshakeError(f"cannot load the receiver's NIXL metadata: {exc}") from exc
        if isinstance(self._remote, bytes):
            self._remote = self._remote.decode()
        self._remote_base = info.base

    def _covered(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._ranges, (addr, float("inf"))) - 1
        return i >= 0 and self._ranges[i][0] <= addr and addr + nbytes <= self._ranges[i][1]

    def write(self, transfer_id: str, chunk_index: int, header: bytes, regions: Sequence[Buffer],
              grant: Grant) -> WriteHandle:
        local: list[tuple[int, int, int]] = []
        mem_type, temp = "DRAM", []
        for r in regions:
            if isinstance(r, DeviceRegion):
                addr, n, dev, mem_type = r.address, r.nbytes, r.device, r.mem_type
            else:
                (addr, n), dev = buffer_address(r), 0
            if not self._covered(addr, n):
                self.dynamic_registrations += 1
                temp.append(self.agent.register_memory([(addr, n, dev, "")], mem_type))
            local.append((addr, n, dev))
        dst = self._remote_base + grant.offset + HEADER_SIZE
        remote, off = [], 0
        for _, n, _ in local:
            remote.append((dst + off, n, 0))
            off += n
        notif = NOTIF.pack(NOTIF_MAGIC, chunk_index, grant.slot, grant.generation) + header
        handle = WriteHandle(transfer_id, chunk_index, grant, HEADER_SIZE + off)
        try:
            xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, mem_type),
                                              self.agent.get_xfer_descs(remote, "DRAM"), self._remote, notif)
            state = self.agent.transfer(xfer)
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            self._drop(temp)
            raise TransportError(f"NIXL WRITE of chunk {chunk_index} failed to post: {exc}") from exc
        handle.native = (xfer, temp)
        self._settle(handle, state)
        return handle

    def _settle(self, handle: WriteHandle, state: str) -> None:
        if state == "PROC":
            return
        assert isinstance(handle.native, tuple)
        xfer, temp = handle.native
        handle.state = WriteState.DONE if state == "DONE" else WriteState.FAILED
        if state != "DONE":
            handle.error = f"NIXL transfer state {state}"
        with contextlib.suppress(Exception):
            self.agent.release_xfer_handle(xfer)
        self._drop(temp)
        handle.native = None

    def _drop(self, regs: list[Any]) -> None:
        for reg in regs:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)

    def poll(self, handle: WriteHandle) -> WriteState:
        if handle.state is WriteState.POSTED and isinstance(handle.native, tuple):
            self._settle(handle, self.agent.check_xfer_state(handle.native[0]))
        return handle.state

    def close(self) -> None:
        if self.agent is None:
            return
        self._drop(self._regs)
        self._regs.clear()
        if self._remote:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(self._remote)
        self.agent = None
