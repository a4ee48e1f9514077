"""NIXL backend (UCX underneath): one-sided WRITEs straight into the decode node's pool.

* The receiver registers the whole pool once (DRAM here; the pool is pinned on
  CUDA hosts) and ships its agent metadata and pool geometry in ``HelloAck.info``.
* One NIXL agent per process (:class:`ProcessAgent`) serves every Sender of that
  process and talks to many remote agents; a remote agent is removed when the
  last Sender using it closes.
* The sender registers the paged KV cache once (:meth:`NixlSender.register_layout`,
  DRAM or VRAM as the layout says) and prepares a descriptor list of every
  ``[layer][block]`` once (``prep_xfer_dlist``). Each peer's pool gets a prepared
  list of every slot's block-sized ranges, once. A chunk is then posted with
  ``make_prepped_xfer`` and two index lists - no registration, no descriptor
  building, no sender-side copy per chunk.
* Payloads given as plain buffers (not named blocks) go through ``initialize_xfer``;
  a buffer outside registered memory is registered for the duration of that write.
* The 128-byte chunk header does not travel as data: it rides in the WRITE's
  notification (``NOTIF``: slot, generation, chunk index, then the header),
  which NIXL delivers only after the payload is complete. The receiver's poller
  writes the header into the slot and reports the arrival. One descriptor less
  per chunk, and no header staging memory on the sender.

Agents are created with the progress thread off and ``backends=[]`` (NIXL's own
progress thread busy-polls a core and, measured on a 2-core host, costs ~8 ms per
64 KiB round trip), the UCX backend with the same ``ucx_error_handling_mode`` on both
sides (a mismatch leaves transfers stuck in PROC), and
completions / notifications are polled from our own threads with an adaptive
backoff (:class:`kvrelay.common.polling.Backoff`) - never a busy-polling progress thread
pinning a core. The receiver only polls while it has slots granted.

Every agent uses NIXL's ``STRICT`` thread-sync mode: the process agent is called from
every push lane thread at once (one per decode node) and the receiver's agent from the
control and polling threads. With NIXL's default for agents without a listener thread
(``NONE``), two lanes posting at the same time left every later WRITE stuck for good.
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
from typing import Any

import msgspec
import numpy as np

from kvrelay.common.errors import HandshakeError, PeerDeadError, TransportError
from kvrelay.common.polling import IDLE_AFTER_S, IDLE_SLEEP_S, Backoff, progress_loop
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.transport.backends.base import (
    BlockPayload,
    Buffer,
    Capabilities,
    Payload,
    ReceiverBackend,
    ReceiverHooks,
    SenderBackend,
    SourceLayout,
    WriteHandle,
    WriteState,
)
from kvrelay.transport.events import Refusal
from kvrelay.transport.pool import ReceivePool, SlotRef
from kvrelay.transport.protocol import Grant

log = logging.getLogger(__name__)
NOTIF = struct.Struct("<4sIIQ16s")       # magic, chunk index, slot, generation, grant token; then the header
NOTIF_MAGIC = b"KVRN"
CONSUMER_GRACE_S = 2e-3     # background polling backs off while a consumer polled this recently


class NixlInfo(msgspec.Struct, frozen=True):
    agent: str
    metadata: bytes
    base: int                 # address of the receiver's pool
    slots: int = 0            # receiver: slots in the pool (slot i at base + i * slot_bytes)
    mem: str = "DRAM"         # the pool's memory: DRAM, or VRAM (transport.pool_device gpu)
    device: int = 0           # ... on this device


def _import_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise TransportError("NIXL is not installed: pip install nixl-cu12 and (--no-deps) nixl; "
                             "bash deploy/setup.sh installs both") from exc
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def translate(exc: Exception, what: str) -> TransportError:
    """A NIXL binding error as ours: a disconnected remote agent is a dead peer."""
    try:
        from nixl._bindings import nixlRemoteDisconnectError
    except ImportError:                       # a NIXL build without the typed errors
        nixlRemoteDisconnectError = ()  # noqa: N806
    if isinstance(exc, nixlRemoteDisconnectError):
        return PeerDeadError(f"{what}: the decode node's NIXL agent disconnected ({exc})")
    return TransportError(f"{what}: {exc}")


def make_agent(name: str, error_mode: str) -> Any:
    """A NIXL agent with no progress thread and a UCX backend in ``error_mode``."""
    nixl_agent, nixl_agent_config, sync = _import_nixl()
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[],
                                                   sync_mode=sync.NIXL_THREAD_SYNC_STRICT))
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
        self._remotes: dict[str, bytes] = {}      # remote agent name -> its metadata
        self._senders: dict[str, str] = {}        # remote agent name -> sender id of its latest Hello

    poll_driven = True
    writes_device_pool = True

    def start(self, pool: ReceivePool, hooks: ReceiverHooks) -> None:
        self._pool, self._hooks = pool, hooks
        self._base = pool.arena.address
        arena = pool.arena       # host pages (DRAM), or device memory (VRAM: transport.pool_device gpu)
        self._reg = self.agent.register_memory([(self._base, pool.num_slots * pool.slot_bytes, arena.device_index, "")],
                                               arena.mem)
        self._thread = threading.Thread(target=self._poll_loop, name="kvrelay-nixl-rx", daemon=True)
        self._thread.start()

    def info(self) -> bytes:
        arena = self._pool.arena
        return msgspec.msgpack.encode(NixlInfo(self.name, self.agent.get_agent_metadata(), self._base,
                                               self._pool.num_slots, arena.mem, arena.device_index))

    def on_hello(self, sender_id: str, info: bytes, data_token: bytes) -> None:
        try:
            meta = msgspec.msgpack.decode(info, type=NixlInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(f"bad NIXL hello info: {exc}") from exc
        with self._lock:
            if self._remotes.get(meta.agent) != meta.metadata:   # a process's agent may say Hello again
                if meta.agent in self._remotes:
                    with contextlib.suppress(Exception):
                        self.agent.remove_remote_agent(meta.agent)
                try:
                    self.agent.add_remote_agent(meta.metadata)
                except Exception as exc:  # noqa: BLE001 - nixl binding errors
                    raise HandshakeError(f"NIXL could not load the sender's metadata: {exc}") from exc
                self._remotes[meta.agent] = meta.metadata
            self._senders[meta.agent] = sender_id      # notifications name the agent; we report the sender

    def on_peer_gone(self, sender_id: str) -> None:
        with self._lock:
            gone = [a for a, s in self._senders.items() if s == sender_id]
            for agent in gone:
                self._senders.pop(agent, None)
                self._remotes.pop(agent, None)
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(agent)

    def on_grants(self, sender_id: str, transfer_id: str, grants: Sequence[tuple[int, SlotRef]],
                  token: bytes) -> None:
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
        progress_loop(self._closed, self._wake, lambda: self._active > 0, self._background_step,
                      Backoff(spin=0, max_sleep=100e-6, idle_after=IDLE_AFTER_S, idle_sleep=IDLE_SLEEP_S))

    def _background_step(self) -> bool | None:
        if time.monotonic() - self._consumer_polled < CONSUMER_GRACE_S:
            time.sleep(CONSUMER_GRACE_S)              # a consumer is driving progress
            return None
        return self._drain() > 0

    def _on_notif(self, agent_name: str, raw: bytes) -> None:
        if len(raw) != NOTIF.size + HEADER_SIZE or raw[:4] != NOTIF_MAGIC:
            log.warning("ignored malformed NIXL notification (%d bytes) from %s", len(raw), agent_name)
            return
        _, chunk_index, slot, gen, token = NOTIF.unpack_from(raw)
        ref = SlotRef(slot, gen)
        header = raw[NOTIF.size:]
        sender = self._senders.get(agent_name)
        if sender is None:                      # no authenticated Hello loaded this agent
            self._hooks.refused(Refusal.UNAUTHENTICATED_DATA, f"NIXL notification from unknown agent {agent_name!r}")
            return
        if self._hooks.admit(sender, header[40:56], chunk_index, ref, token) is not None:
            return                              # refused (counted); the header is not copied in
        try:
            self._pool.begin_write(ref)         # the slot must still be leased to this chunk
        except TransportError:
            self._hooks.deliver(sender, header[40:56], chunk_index, ref, token)   # counted as stale
            return
        try:
            self._pool.header_view(ref)[:] = header
        finally:
            self._pool.end_write(ref)
        self._hooks.deliver(sender, header[40:56], chunk_index, ref, token)

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


def slot_blocks(slot_bytes: int, block_bytes: int) -> int:
    """Block-sized ranges after the header in one pool slot: the remote list's stride per slot."""
    return (slot_bytes - HEADER_SIZE) // block_bytes


class ProcessAgent:
    """The one NIXL agent of this process (per UCX error mode), shared by every NixlSender.

    Owns what is registered once per process: the KV layout (memory + a prepared local
    descriptor list of every ``[region][block]``), remote agents (reference counted by
    the Senders using them) and each remote pool's prepared list of slot ranges.
    Thread-safe; Senders may live on different threads.
    """

    _instances: dict[str, ProcessAgent] = {}
    _class_lock = threading.Lock()

    @classmethod
    def get(cls, error_mode: str) -> ProcessAgent:
        with cls._class_lock:
            inst = cls._instances.get(error_mode)
            if inst is None:
                inst = cls._instances[error_mode] = cls(error_mode)
            return inst

    def __init__(self, error_mode: str) -> None:
        self.name = f"kvrelay-{error_mode}-{uuid.uuid4().hex[:12]}"
        self.agent = make_agent(self.name, error_mode)
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []                 # registered (start, end), sorted
        self._layouts: dict[SourceLayout, Any] = {}              # layout -> prepared local dlist
        self._remotes: dict[str, int] = {}                       # remote agent -> Senders using it
        self._remote_dlists: dict[tuple[str, int], Any] = {}     # (remote, block bytes) -> dlist

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def register_layout(self, layout: SourceLayout) -> Any:
        """Register the layout's memory and prepare its block list, once per process."""
        with self._lock:
            if layout in self._layouts:
                return self._layouts[layout]
            mem_type = layout.regions[0].mem_type.value
            try:
                self.agent.register_memory([(r.address, r.nbytes, r.device, "") for r in layout.regions], mem_type)
                descs = [(r.address + b * layout.block_bytes, layout.block_bytes, r.device)
                         for r in layout.regions for b in range(layout.blocks_per_region())]
                dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
            except Exception as exc:  # noqa: BLE001 - nixl binding errors
                raise TransportError(f"NIXL could not register the KV layout: {exc}") from exc
            for r in layout.regions:
                bisect.insort(self._ranges, (r.address, r.address + r.nbytes))
            self._layouts[layout] = dlist
            return dlist

    def covered(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._ranges, (addr, float("inf"))) - 1
            return i >= 0 and self._ranges[i][0] <= addr and addr + nbytes <= self._ranges[i][1]

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001 - nixl binding errors
                raise HandshakeError(f"cannot load the receiver's NIXL metadata: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] = self._remotes.get(name, 0) + 1
            return name

    def remote_dlist(self, remote: str, info: NixlInfo, slot_bytes: int, block_bytes: int) -> Any:
        """The remote pool as ``slots x regions`` block-sized ranges after each slot's header."""
        with self._lock:
            key = (remote, block_bytes)
            if key not in self._remote_dlists:
                per_slot = slot_blocks(slot_bytes, block_bytes)
                descs = [(info.base + s * slot_bytes + HEADER_SIZE + j * block_bytes, block_bytes, info.device)
                         for s in range(info.slots) for j in range(per_slot)]
                try:
                    self._remote_dlists[key] = self.agent.prep_xfer_dlist(remote, descs, info.mem)
                except Exception as exc:  # noqa: BLE001 - nixl binding errors
                    raise TransportError(f"NIXL could not prepare {remote}'s slot list: {exc}") from exc
            return self._remote_dlists[key]

    def drop_remote(self, remote: str) -> None:
        """One Sender stopped using ``remote``; the last one removes it (and its lists)."""
        with self._lock:
            left = self._remotes.get(remote, 0) - 1
            if left > 0:
                self._remotes[remote] = left
                return
            self._remotes.pop(remote, None)
            for key in [k for k in self._remote_dlists if k[0] == remote]:
                with contextlib.suppress(Exception):
                    self.agent.release_dlist_handle(self._remote_dlists.pop(key))
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(remote)



class NixlSender(SenderBackend):
    """One decode node's data path on the process's shared agent."""

    capabilities = Capabilities(registered_layout=True)

    def __init__(self, *, error_mode: str = "none") -> None:
        self.error_mode = error_mode
        self.shared: ProcessAgent | None = None
        self._remote = ""
        self._info: NixlInfo | None = None
        self._slot_bytes = 0
        self._layout: SourceLayout | None = None
        self._local_dlist: Any = None
        self.dynamic_registrations = 0

    @property
    def agent(self) -> Any:
        if self.shared is None:
            raise TransportError("NIXL sender used before local_info/connect")
        return self.shared.agent

    def local_info(self, sender_id: str) -> bytes:
        self.shared = ProcessAgent.get(self.error_mode)
        return msgspec.msgpack.encode(NixlInfo(self.shared.name, self.shared.metadata(), 0))

    def register_layout(self, layout: SourceLayout) -> None:
        if self.shared is None:
            self.shared = ProcessAgent.get(self.error_mode)
        self._local_dlist = self.shared.register_layout(layout)
        self._layout = layout

    def connect(self, sender_id: str, receiver_info: bytes, slot_bytes: int, data_token: bytes) -> None:
        if self.shared is None:
            self.shared = ProcessAgent.get(self.error_mode)
        try:
            info = msgspec.msgpack.decode(receiver_info, type=NixlInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(f"bad NIXL receiver info: {exc}") from exc
        self._remote = self.shared.add_remote(info.metadata)
        self._info, self._slot_bytes = info, slot_bytes

    def write(self, transfer_id: str, chunk_index: int, header: bytes, payload: Payload,
              grant: Grant) -> WriteHandle:
        notif = NOTIF.pack(NOTIF_MAGIC, chunk_index, grant.slot, grant.generation, grant.token) + header
        temp: list[Any] = []
        if isinstance(payload, BlockPayload):
            xfer = self._prepped(payload, grant, notif)      # raises unless a layout is registered
            assert self._layout is not None
            nbytes = self._layout.payload_bytes(payload)
        else:
            xfer, temp, nbytes = self._initialized(payload, grant, notif, chunk_index)
        handle = WriteHandle(transfer_id, chunk_index, grant, HEADER_SIZE + nbytes)
        try:
            state = self.agent.transfer(xfer)
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            self._drop(temp)
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(xfer)
            raise translate(exc, f"NIXL WRITE of chunk {chunk_index} failed to post") from exc
        handle.native = (xfer, temp)
        self._settle(handle, state)
        return handle

    def _prepped(self, payload: BlockPayload, grant: Grant, notif: bytes) -> Any:
        """``make_prepped_xfer`` from the prepared block list into the peer's prepared slot list."""
        layout, info, shared = self._layout, self._info, self.shared
        if layout is None or info is None or shared is None:
            raise TransportError("BlockPayload written before register_layout and connect")
        remote_dlist = shared.remote_dlist(self._remote, info, self._slot_bytes, layout.block_bytes)
        per_region, ids = layout.blocks_per_region(), payload.block_ids
        local = [r * per_region + b for r in range(len(layout.regions)) for b in ids]    # [region][block]
        per_slot = slot_blocks(self._slot_bytes, layout.block_bytes)
        remote = [grant.slot * per_slot + j for j in range(len(local))]
        try:
            return self.agent.make_prepped_xfer("WRITE", self._local_dlist, local, remote_dlist, remote, notif)
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            raise translate(exc, "NIXL could not post a prepared WRITE") from exc

    def _initialized(self, payload: Sequence[Buffer], grant: Grant, notif: bytes,
                     chunk_index: int) -> tuple[Any, list[Any], int]:
        """``initialize_xfer`` of host buffers; buffers outside registered memory are registered
        for this write only."""
        assert self.shared is not None and self._info is not None
        local: list[tuple[int, int, int]] = []
        temp: list[Any] = []
        for r in payload:
            addr, n = buffer_address(r)
            if not self.shared.covered(addr, n):
                self.dynamic_registrations += 1
                temp.append(self.agent.register_memory([(addr, n, 0, "")], "DRAM"))
            local.append((addr, n, 0))
        dst = self._info.base + grant.offset + HEADER_SIZE
        remote, off = [], 0
        for _, n, _ in local:
            remote.append((dst + off, n, self._info.device))
            off += n
        try:
            xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, "DRAM"),
                                              self.agent.get_xfer_descs(remote, self._info.mem), self._remote, notif)
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            self._drop(temp)
            raise translate(exc, f"NIXL WRITE of chunk {chunk_index} failed to post") from exc
        return xfer, temp, off

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
            try:
                state = self.agent.check_xfer_state(handle.native[0])
            except Exception as exc:  # noqa: BLE001 - nixl binding errors: the write failed
                state = f"ERR ({exc})"
            self._settle(handle, state)
        return handle.state

    def cancel(self, handle: WriteHandle) -> None:
        if handle.state is WriteState.POSTED and isinstance(handle.native, tuple):
            self._settle(handle, "CANCELLED")       # releases the xfer handle (NIXL cancels if it can)
        super().cancel(handle)

    def close(self) -> None:
        """Stop using the remote agent (the last Sender on it removes it). The process's agent and
        its registered layout stay: they outlive any one peer."""
        if self.shared is not None and self._remote:
            self.shared.drop_remote(self._remote)
        self._remote = ""
        self._info = None
