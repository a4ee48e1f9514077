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

import contextlib
import enum
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

from kvrelay.common import numa
from kvrelay.common.errors import PoolFullError, TransportError

log = logging.getLogger(__name__)
PAGE = 4096
Clock = Callable[[], float]
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)     # Linux 5.14+; Python 3.11 lacks the name


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


class Arena:
    """Page-aligned memory behind the pool. Subclasses: shared (``shm``) or private."""

    buf: memoryview
    name: str = ""
    pinned: bool = False

    @property
    def address(self) -> int:
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def populate(self) -> bool:
        """Fault every page of the arena in, writable, now (blocks; idempotent).

        False, with a warning, where the kernel cannot (before 5.14) or the memory is not
        there (a full ``/dev/shm``): the pool still works and faults its pages lazily. Never
        touches the bytes, so it cannot raise SIGBUS on a short tmpfs."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        t0 = time.monotonic()
        rc = libc.madvise(ctypes.c_void_p(self.address), ctypes.c_size_t(self.buf.nbytes), MADV_POPULATE_WRITE)
        if rc != 0:
            err = ctypes.get_errno()
            log.warning("receive pool not populated (%s): its pages fault in on first use",
                        os.strerror(err))
            return False
        log.info("receive pool: %d MiB faulted in at start-up in %.2f s", self.buf.nbytes >> 20,
                 time.monotonic() - t0)
        return True

    def pin_if_cuda(self) -> bool:
        """Page-lock the arena for CUDA when a GPU is present (idempotent). No-op otherwise."""
        if self.pinned:
            return True
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.buf.nbytes, 0)
        self.pinned = int(rc) == 0
        if not self.pinned:
            _clear_cuda_error()     # else the next kernel launch in this process reports it
            log.warning("cudaHostRegister failed (%s); receive pool is pageable", rc)
        return self.pinned

    def _unpin(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False

    def close(self) -> None:
        raise NotImplementedError


def _clear_cuda_error() -> None:
    """Reset the runtime's last-error after a failed host registration (torch checks it after
    every launch). Best effort: needs NVIDIA's cuda-python, else the error stays to be seen."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return
    runtime.cudaGetLastError()


class PrivateArena(Arena):
    """Anonymous private memory: for backends whose peers never map the pool (nixl, tcp, ucx).

    Measured here: NIXL/UCX CMA writes into private pages run ~20 % faster than into
    tmpfs-backed shared pages, and faster again with transparent huge pages
    (``MADV_HUGEPAGE``; the kernel walks one 2 MiB page instead of 512 small ones).
    """

    def __init__(self, nbytes: int) -> None:
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):    # fewer page walks for CMA/RDMA
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self._unpin()
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            log.warning("private arena still has exported views; unmapped at exit")


class SharedArena(Arena):
    """A page-aligned shared-memory segment other processes can attach by name.

    The creator uses :mod:`multiprocessing.shared_memory` (which unlinks the segment
    if the process dies). Attaching maps ``/dev/shm/<name>`` directly, so the
    attaching process never registers the segment with its resource tracker - in
    Python 3.11 that registration would unlink the receiver's pool at exit.
    """

    def __init__(self, nbytes: int, *, name: str | None = None, create: bool = True) -> None:
        self.owner = create
        self.shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if create:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            assert self.shm.buf is not None
            self.buf: memoryview = self.shm.buf
            self.name: str = self.shm.name
            return
        if not name:
            raise TransportError("attaching a shared arena needs its name")
        try:
            fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        except OSError as exc:
            raise TransportError(f"cannot attach shared memory {name!r}: {exc}") from exc
        try:
            # MAP_POPULATE: map the receiver's (populated) pages now, not on the first write to each
            self._mmap = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self._unpin()
        self.buf.release()
        try:
            if self.shm is not None:
                self.shm.close()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:     # a view is still exported (e.g. a registered array): unmapped at exit
            log.warning("shared segment %s still has exported views; unlinking anyway", self.name)
        if self.owner and self.shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


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
                 quarantine_s: float = 0.5, numa_node: int | None = None) -> None:
        """``numa_node``: the NUMA node its pages are bound to before they are faulted in and
        pinned (:mod:`kvrelay.common.numa`; None: the kernel's choice)."""
        self.slot_bytes = round_up(slot_bytes, PAGE)
        self.num_slots = pool_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise TransportError(f"pool_bytes={pool_bytes} cannot hold one {self.slot_bytes}-byte slot")
        size = self.num_slots * self.slot_bytes
        self.arena: Arena = SharedArena(size) if shared else PrivateArena(size)
        self.numa_node = numa_node if numa.bind(self.arena.address, size, numa_node) else None
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
        """Writable view of a slot (``nbytes`` long, default the whole slot)."""
        off = self.offset(ref)
        return self.arena.buf[off:off + (self.slot_bytes if nbytes is None else nbytes)]

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
