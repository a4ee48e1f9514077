"""The data-plane contract every backend implements (nixl, tcp, shm, ucx).

A backend has two halves that live in different processes:

* :class:`ReceiverBackend` on the decode node, bound to the :class:`ReceivePool`
  through :class:`ReceiverHooks`. It learns that a chunk's bytes are complete in a slot
  and reports it by calling ``deliver(sender_id, transfer_tag, chunk_index, SlotRef,
  token, payload_sum)`` (any thread). ``sender_id`` is the *authenticated* sender of
  the connection or agent the bytes came by (never a name the write itself claims);
  ``token`` is the grant token the write presented. A backend that can look before the
  bytes land (tcp) asks ``admit(...)`` first and discards a refused write without
  touching the slot. ``payload_sum`` is the xxh3_64 the backend computed over the payload
  bytes *in the slot* as they landed (tcp hashes each received piece while it
  is hot in cache), or None; the receiver then verifies - hashing the slot
  itself when no sum was given - and publishes the arrival. A receive the library
  failed is reported at once with ``chunk_failed(sender_id, tag, chunk_index, SlotRef,
  reason)`` (the chunk is rejected, not left to its lease); a broken data connection
  with ``peer_lost(sender_id, reason)``.
* :class:`SenderBackend` on the prefill node. ``write`` posts one chunk
  (header + ``[layer][block]`` payload regions) into a granted slot and returns a
  :class:`WriteHandle`; ``poll``/``wait`` report completion.

Handshake data flows through the authenticated control plane: ``SenderBackend.local_info()``
travels in ``Hello.info`` to ``ReceiverBackend.on_hello``, and
``ReceiverBackend.info()`` returns in ``HelloAck.info`` to ``SenderBackend.connect``,
both under the Hello's MACs. Both ends also get the session's ``data_token``: a backend
with its own connections (tcp, shm) makes the sender present it, once, before anything
on that connection is read.
Every backend reports arrival in band (the data path itself tells the receiver).

Callers never branch on a backend's name; they ask its :class:`Capabilities`:

* ``registered_layout`` - the backend can write a chunk straight from registered KV
  memory: the caller registers the cache once (:meth:`SenderBackend.register_layout`)
  and names a chunk's payload by block ids (:class:`BlockPayload`), with no
  sender-side copy. Otherwise the payload is a list of host buffers.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrelay.transport.events import Refusal
from kvrelay.transport.pool import ReceivePool, SlotRef
from kvrelay.transport.protocol import Grant

Buffer = bytes | bytearray | memoryview


class DeliverFn(Protocol):
    def __call__(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes,
                 payload_sum: int | None = None, /) -> None: ...


class AdmitFn(Protocol):
    def __call__(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes, /) -> Refusal | None: ...


PeerLostFn = Callable[[str, str], None]


class ChunkFailedFn(Protocol):
    def __call__(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, reason: str, /) -> None: ...


RefusedFn = Callable[[Refusal, str], None]


@dataclass(frozen=True)
class ReceiverHooks:
    """The receiver's callbacks into which a backend reports (any thread, non-blocking).

    ``admit`` says whether a write may touch its slot (None = yes; it counts a refusal);
    ``refused`` counts a refusal the backend made on its own (an unauthenticated connection)."""

    deliver: DeliverFn
    admit: AdmitFn
    peer_lost: PeerLostFn
    chunk_failed: ChunkFailedFn
    refused: RefusedFn


class MemType(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class MemRegion:
    """A long-lived region by raw address: host memory, or device memory (never a Python buffer)."""

    address: int
    nbytes: int
    mem_type: MemType = MemType.DRAM
    device: int = 0


@dataclass(frozen=True)
class SourceLayout:
    """Registered KV memory: ``regions[r]`` (one per layer) holds whole blocks of ``block_bytes``."""

    regions: tuple[MemRegion, ...]
    block_bytes: int

    def blocks_per_region(self) -> int:
        return self.regions[0].nbytes // self.block_bytes

    def payload_bytes(self, payload: BlockPayload) -> int:
        """Bytes of a chunk named by ``payload``: every region's share of its blocks."""
        return len(self.regions) * len(payload.block_ids) * self.block_bytes


@dataclass(frozen=True)
class BlockPayload:
    """A chunk payload named by blocks of the registered layout, in ``[region][block]`` order."""

    block_ids: tuple[int, ...]


Payload = Sequence[Buffer] | BlockPayload


@dataclass(frozen=True)
class Capabilities:
    registered_layout: bool = False    # write() takes a BlockPayload after register_layout()


class WriteState(enum.Enum):
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"


@dataclass
class WriteHandle:
    transfer_id: str
    chunk_index: int
    grant: Grant
    nbytes: int
    state: WriteState = WriteState.POSTED
    error: str = ""
    native: object = field(default=None, repr=False)   # backend's own request object


class ReceiverBackend(abc.ABC):
    """Decode-node half. Created by :class:`kvrelay.transport.receiver.Receiver`."""

    needs_shared_pool: bool = False     # peers map the pool by name (shm)
    writes_device_pool: bool = False    # peers' one-sided writes can land in device memory (nixl: VRAM)

    @abc.abstractmethod
    def start(self, pool: ReceivePool, hooks: ReceiverHooks) -> None:
        """Bind to the pool and start any I/O threads. Called once, before ``info``."""

    @abc.abstractmethod
    def info(self) -> bytes:
        """Connection data for senders (sent in ``HelloAck.info``). Non-blocking."""

    def on_hello(self, sender_id: str, info: bytes, data_token: bytes) -> None:  # noqa: B027 - optional hook
        """A sender passed the authenticated handshake; ``info`` is its ``local_info()`` and
        ``data_token`` what its data connection must present (once). Non-blocking."""

    def on_grants(self, sender_id: str, transfer_id: str, grants: Sequence[tuple[int, SlotRef]],  # noqa: B027
                  token: bytes) -> None:
        """Slots were granted for (chunk_index, slot) under the transfer's grant ``token``.
        E.g. ucx posts receives, nixl starts polling."""

    def on_release(self, sender_id: str, transfer_id: str) -> None:  # noqa: B027
        """The transfer ended (complete, aborted or failed); drop per-transfer state."""

    def on_peer_gone(self, sender_id: str) -> None:  # noqa: B027
        """The sender is gone (dead, or said Bye); drop per-peer state such as a remote agent.
        Any thread (the receiver's lock may be held); non-blocking."""

    poll_driven: bool = False

    def progress(self) -> int:
        """Poll-driven backends (``poll_driven = True``: nixl, ucx) drain completions here and
        ``deliver`` them; returns how many. Called from the consumer's own thread while it
        waits in ``Receiver.next_event`` (no thread hand-off on the hot path); a background
        thread polls only while no consumer does. Non-blocking; thread-safe."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads, deregister memory. Idempotent."""


class SenderBackend(abc.ABC):
    """Prefill-node half. One instance talks to one receiver."""

    capabilities = Capabilities()

    def local_info(self, sender_id: str) -> bytes:
        """Data for the receiver's ``on_hello`` (e.g. NIXL agent metadata). Called before ``connect``."""
        return b""

    @abc.abstractmethod
    def connect(self, sender_id: str, receiver_info: bytes, slot_bytes: int, data_token: bytes) -> None:
        """Open the data path to the receiver described by ``receiver_info`` (authenticated by
        the HelloAck's MAC), presenting ``data_token`` where the path has its own connection.
        Blocks until ready."""

    def register_layout(self, layout: SourceLayout) -> None:
        """Register long-lived source memory (the paged KV cache) once; later writes name its
        blocks with :class:`BlockPayload`. Only for ``capabilities.registered_layout``. Blocks."""
        raise NotImplementedError(f"{type(self).__name__} cannot write from a registered layout")

    @abc.abstractmethod
    def write(self, transfer_id: str, chunk_index: int, header: bytes, payload: Payload,
              grant: Grant) -> WriteHandle:
        """Post header + payload into the granted slot, presenting ``grant.token``. May complete
        synchronously. Library errors are raised as :class:`kvrelay.common.errors.TransportError`."""

    @abc.abstractmethod
    def poll(self, handle: WriteHandle) -> WriteState:
        """Non-blocking completion check."""

    def cancel(self, handle: WriteHandle) -> None:
        """Give up on a posted write (best effort: the library may cancel it or let it finish);
        the handle is FAILED afterwards and its resources are released. Non-blocking."""
        if handle.state is WriteState.POSTED:
            handle.state, handle.error = WriteState.FAILED, "cancelled"
        handle.native = None

    def wait(self, handle: WriteHandle, timeout: float) -> WriteState:
        """Block until the write is done or failed, or ``timeout`` passes (then POSTED)."""
        from kvrelay.common.polling import Backoff

        backoff = Backoff(timeout)
        while (state := self.poll(handle)) is WriteState.POSTED and backoff.wait():
            pass
        return state

    @abc.abstractmethod
    def close(self) -> None:
        """Close the data path. Idempotent."""


def host_buffers(payload: Payload) -> Sequence[Buffer]:
    """The payload as host buffers, for backends without ``registered_layout``."""
    if isinstance(payload, BlockPayload):
        raise TypeError("this backend cannot write a BlockPayload (capabilities.registered_layout is False)")
    return payload
