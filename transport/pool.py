"""The decode node's receive pool: one registered buffer split into chunk slots.

One page-aligned arena backs the whole pool: a shared-memory segment
(``/dev/shm``) for the same-host ``shm`` backend, which writes into it from
another process, and private anonymous memory otherwise (NIXL/UCX register it
once; their CMA writes into private pages are faster). When CUDA is present the pages are additionally
pinned with ``cudaHostRegister`` so host→device installs run at full speed.

The arena is populated when the pool is made: every page is faulted in, writable
(``MADV_POPULATE_WRITE``), so no chunk pays for it. Left to fault lazily, the first
write into each slot allocated and zeroed its pages inside the transport's copy;
measured on this project's VM hosts that ran at ~0.4 GB/s (5-7 ms of CPU per 2 MiB chunk,
``clear_page`` under ``recvfrom``), and a pool reuses slots in FIFO order, so a decode
node paid it on every chunk until it had cycled through the whole pool (127 slots at
the default size). Populating 256 MiB costs ~0.7 s once, at start-up.

Slot lifecycle (``SlotState``)::

    FREE ──allocate──▶ LEASED ──mark_filled──▶ FILLED ──take──▶ HELD ──release(refs→0)──▶ FREE
                         │                       │
                         └──── lease deadline ───┴──▶ FREE  (reclaimed, counted in leases_expired)

``LEASED`` and ``FILLED`` slots carry a deadline: a slot that is never filled
(dead sender) or never consumed (dead consumer) is reclaimed by
:meth:`ReceivePool.reap_expired`. ``HELD`` slots are owned by a consumer and
reference counted (:meth:`retain` / :meth:`release`); they have no deadline.
Every slot carries a generation that bumps on each allocation, so a late write
or notification for a reclaimed slot is recognised as stale and rejected.

All methods are thread-safe. :meth:`allocate` blocks (back-pressure) until
enough slots are free or its deadline passes; nothing else blocks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.common import numa
from kvrelay.common.errors import ConfigError, PoolFullError, TransportError
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.transport.arenas import DeviceArena, PrivateArena, SharedArena

log = logging.getLogger(__name__)
PAGE = 4096
Clock = Callable[[], float]


@dataclass(frozen=True)
class Placement:
    """Where a pool's memory lives: ``device`` (``cuda:0``...) for a pool in device memory, None
    for host pages, which ``numa_node`` binds (:mod:`kvrelay.common.numa`; None: the kernel's choice)."""

    device: str | None = None
    numa_node: int | None = None


HOST = Placement()


class SlotState(enum.Enum):
    FREE = "free"
    LEASED = "leased"      # granted to a sender, waiting for bytes
    FILLED = "filled"      # bytes landed and verified, waiting for the consumer
    HELD = "held"          # taken by a consumer (reference counted)


@dataclass(frozen=True, order=True)
class SlotRef:
    """A slot at one generation. Stale refs are rejected by every method."""

    index: int
    generation: int


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    generation: int = 0
    owner: str = ""
    deadline: float = 0.0
    refs: int = 0
    writing: int = 0       # data-plane writes in progress: the reaper must not reclaim


@dataclass(frozen=True)
class PoolStats:
    slots: int
    free: int
    leased: int
    filled: int
    held: int
    leases_expired: int
    allocations: int
    refusals: int
    quarantined: int = 0      # FREE slots not yet reusable (a late write may still land in them)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class ReceivePool:
    """Fixed-size chunk slots over one :class:`SharedArena`.

    ``clock`` is injectable so lease expiry can be tested without sleeping.

    Fencing against late writers: a slot is reused in FIFO order (the one freed longest
    ago first), and a slot freed before it was ever FILLED (an abort, a failed transfer,
    an expired lease: its write may still be in flight, e.g. a one-sided NIXL WRITE) is
    quarantined for ``quarantine_s`` before it can be leased again. Generations fence
    every write that is announced (tcp frames, NIXL notifications, ucx tags); the
    consumer's checksum of the bytes it installs catches anything else.
    """

    def __init__(self, pool_bytes: int, slot_bytes: int, *, lease_s: float = 10.0,
                 clock: Clock = time.monotonic, pin: bool = True, shared: bool = True,
                 quarantine_s: float = 0.5, placement: Placement = HOST) -> None:
        """``placement``: host pages (bound to a NUMA node before they are faulted in and
        pinned) or device memory, whose slot headers are then kept on the host."""
        self.slot_bytes = round_up(slot_bytes, PAGE)
        self.num_slots = pool_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise TransportError(f"pool_bytes={pool_bytes} cannot hold one {self.slot_bytes}-byte slot")
        size = self.num_slots * self.slot_bytes
        self.arena: SharedArena | PrivateArena | DeviceArena
        self.on_device = placement.device is not None
        self._headers = [bytearray(HEADER_SIZE) for _ in range(self.num_slots)] if self.on_device else []
        self.numa_node: int | None = None
        self.populated = False
        if placement.device is not None:
            if shared:
                raise TransportError("a pool in device memory cannot be shared with another process (shm)")
            self.arena = DeviceArena(size, placement.device)
        else:
            self.arena = SharedArena(size) if shared else PrivateArena(size)
            self.numa_node = placement.numa_node if numa.bind(self.arena.address, size, placement.numa_node) else None
            self.populated = self.arena.populate()
            if pin:
                self.arena.pin_if_cuda()
        self.lease_s = lease_s
        self._clock = clock
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._free: deque[int] = deque(range(self.num_slots))  # FIFO: the longest-free slot first
        self._quarantine: deque[tuple[float, int]] = deque()    # (reusable at, slot), in time order
        self.quarantine_s = quarantine_s
        self._cond = threading.Condition()
        self._expired = 0
        self._allocations = 0
        self._refusals = 0
        self._closed = False

    # -- addressing ---------------------------------------------------------------------
    def offset(self, ref: SlotRef | int) -> int:
        index = ref.index if isinstance(ref, SlotRef) else ref
        return index * self.slot_bytes

    def view(self, ref: SlotRef | int, nbytes: int | None = None) -> memoryview:
        """Writable view of a host pool's slot (``nbytes`` long, default the whole slot)."""
        if isinstance(self.arena, DeviceArena):
            raise TransportError("a pool in device memory has no host view of its slots")
        off = self.offset(ref)
        return self.arena.buf[off:off + (self.slot_bytes if nbytes is None else nbytes)]

    def header_view(self, ref: SlotRef | int) -> memoryview:
        """The slot's chunk header, writable, in host memory (beside the slot for a pool in
        device memory, whose headers arrive in the writes' notifications)."""
        if self.on_device:
            return memoryview(self._headers[ref.index if isinstance(ref, SlotRef) else ref])
        return self.view(ref, HEADER_SIZE)

    def payload(self, ref: SlotRef | int, nbytes: int) -> Any:
        """The ``nbytes`` after the slot's header: a memoryview of host pages, or a uint8 tensor
        view of device memory (``on_device``)."""
        off = self.offset(ref) + HEADER_SIZE
        if isinstance(self.arena, DeviceArena):
            return self.arena.tensor[off:off + nbytes]
        return self.arena.buf[off:off + nbytes]

    # -- allocation ---------------------------------------------------------------------
    def try_allocate(self, n: int, owner: str) -> list[SlotRef] | None:
        """Allocate ``n`` slots now, or return ``None`` if fewer are free."""
        if n > self.num_slots:
            raise PoolFullError(f"{n} slots requested but the pool has only {self.num_slots}")
        with self._cond:
            self._check_open()
            self._release_quarantine()
            if len(self._free) < n:
                return None
            return [self._lease(self._free.popleft(), owner) for _ in range(n)]

    def allocate(self, n: int, owner: str, timeout: float) -> list[SlotRef]:
        """Allocate ``n`` slots, waiting up to ``timeout`` s for space (back-pressure)."""
        if n > self.num_slots:
            raise PoolFullError(f"{n} slots requested but the pool has only {self.num_slots}")
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                self._check_open()
                self._release_quarantine()
                if len(self._free) >= n:
                    return [self._lease(self._free.popleft(), owner) for _ in range(n)]
                remaining = deadline - self._clock()
                if remaining <= 0:
                    self._refusals += 1
                    raise PoolFullError(f"receive pool full: {n} slots wanted, {len(self._free)} free "
                                        f"of {self.num_slots} after {timeout:.3g}s")
                self._cond.wait(min(remaining, 0.05))

    def _lease(self, index: int, owner: str) -> SlotRef:
        slot = self._slots[index]
        slot.state, slot.owner, slot.refs = SlotState.LEASED, owner, 1
        slot.generation += 1
        slot.deadline = self._clock() + self.lease_s
        self._allocations += 1
        return SlotRef(index, slot.generation)

    # -- transitions --------------------------------------------------------------------
    def _get(self, ref: SlotRef, *states: SlotState) -> _Slot:
        if not 0 <= ref.index < self.num_slots:
            raise TransportError(f"slot {ref.index} out of range (pool has {self.num_slots})")
        slot = self._slots[ref.index]
        if slot.generation != ref.generation or slot.state not in states:
            raise TransportError(f"stale or invalid slot {ref.index}@{ref.generation} "
                                 f"(now {slot.state.value}@{slot.generation})")
        return slot

    def begin_write(self, ref: SlotRef) -> str:
        """Pin a LEASED slot while bytes stream into it; returns its owner."""
        with self._cond:
            slot = self._get(ref, SlotState.LEASED)
            slot.writing += 1
            return slot.owner

    def end_write(self, ref: SlotRef) -> None:
        with self._cond:
            slot = self._slots[ref.index]
            if slot.generation == ref.generation and slot.writing > 0:
                slot.writing -= 1

    def mark_filled(self, ref: SlotRef) -> None:
        with self._cond:
            slot = self._get(ref, SlotState.LEASED)
            slot.state = SlotState.FILLED
            slot.deadline = self._clock() + self.lease_s

    def take(self, ref: SlotRef) -> None:
        """The consumer takes a FILLED slot; it must :meth:`release` it afterwards."""
        with self._cond:
            slot = self._get(ref, SlotState.FILLED)
            slot.state = SlotState.HELD

    def retain(self, ref: SlotRef) -> None:
        with self._cond:
            self._get(ref, SlotState.HELD).refs += 1

    def release(self, ref: SlotRef) -> bool:
        """Drop one reference (any non-free state). Returns True if the slot became free."""
        with self._cond:
            slot = self._get(ref, SlotState.LEASED, SlotState.FILLED, SlotState.HELD)
            slot.refs -= 1
            if slot.refs > 0:
                return False
            self._free_slot(ref.index)
            return True

    def release_owner(self, owner: str, *, include_filled: bool = True) -> int:
        """Free every LEASED (and FILLED) slot of ``owner``. HELD slots stay with the consumer."""
        states = {SlotState.LEASED, SlotState.FILLED} if include_filled else {SlotState.LEASED}
        with self._cond:
            hits = [i for i, s in enumerate(self._slots) if s.owner == owner and s.state in states]
            for i in hits:
                self._free_slot(i)
            return len(hits)

    def reap_expired(self) -> list[tuple[SlotRef, str, SlotState]]:
        """Reclaim LEASED/FILLED slots past their deadline; returns (ref, owner, old state)."""
        now = self._clock()
        out: list[tuple[SlotRef, str, SlotState]] = []
        with self._cond:
            for i, s in enumerate(self._slots):
                if s.state in (SlotState.LEASED, SlotState.FILLED) and s.deadline <= now and not s.writing:
                    out.append((SlotRef(i, s.generation), s.owner, s.state))
                    self._free_slot(i)
                    self._expired += 1
        for ref, owner, state in out:
            log.warning("lease expired: slot %d of %r reclaimed while %s", ref.index, owner, state.value)
        return out

    def _free_slot(self, index: int) -> None:
        slot = self._slots[index]
        never_filled = slot.state is SlotState.LEASED
        slot.state, slot.owner, slot.refs, slot.deadline, slot.writing = SlotState.FREE, "", 0, 0.0, 0
        if never_filled and self.quarantine_s > 0:
            self._quarantine.append((self._clock() + self.quarantine_s, index))
        else:
            self._free.append(index)
        self._cond.notify_all()

    def _release_quarantine(self) -> None:
        now = self._clock()
        while self._quarantine and self._quarantine[0][0] <= now:
            self._free.append(self._quarantine.popleft()[1])

    # -- introspection ------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._cond:
            counts = {st: 0 for st in SlotState}
            for s in self._slots:
                counts[s.state] += 1
            return PoolStats(slots=self.num_slots, free=counts[SlotState.FREE],
                             leased=counts[SlotState.LEASED], filled=counts[SlotState.FILLED],
                             held=counts[SlotState.HELD], leases_expired=self._expired,
                             allocations=self._allocations, refusals=self._refusals,
                             quarantined=len(self._quarantine))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("receive pool is closed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.arena.close()


AUTO_POOL_PROMPTS = 2            # transport.pool_bytes 0 (auto): room for this many prompts of max_model_len
AUTO_POOL_MIN_BYTES = 256 << 20


def receive_pool_bytes(configured: int, slot_bytes: int, max_model_len: int, chunk_tokens: int) -> int:
    """The receive pool's size: ``configured``, or (0) room for AUTO_POOL_PROMPTS maximal prompts.

    Raises ConfigError when a configured pool cannot hold one prompt of ``max_model_len``
    tokens: every such prompt would be refused and recomputed, so fail at start-up instead."""
    per_prompt = -(-max_model_len // chunk_tokens) * round_up(slot_bytes, PAGE)
    if configured == 0:
        return max(AUTO_POOL_PROMPTS * per_prompt, AUTO_POOL_MIN_BYTES)
    if configured < per_prompt:
        raise ConfigError(f"transport.pool_bytes={configured} cannot hold one prompt of max_model_len="
                          f"{max_model_len} tokens ({per_prompt} bytes in {slot_bytes}-byte chunk slots); "
                          f"raise it, or set 0 to size it automatically")
    return configured
