"""The receiver's records of transfers: granted ones, and Allocs it cannot grant yet.

A :class:`GrantedTransfer` holds a transfer's slots and what became of each chunk. An Alloc parks when the pool is full, or while it waits for its consumer to register
(``consumer_wait_s``). Every housekeeping tick :meth:`Parking.sweep` grants what fits now
and refuses what passed its deadline; a sender that gives up on a parked Alloc (an Abort)
takes it out with :meth:`Parking.withdraw` before it can take a slot. Owned by the
receiver's control thread: not thread-safe, and nothing here blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.transport import protocol as P
from kvrelay.transport.pool import SlotRef


@dataclass
class GrantedTransfer:
    transfer_id: str
    sender_id: str
    keys: list[bytes]
    held: tuple[int, ...]
    tag: bytes
    token: bytes = b""                                           # writes must present it
    slots: dict[int, SlotRef] = field(default_factory=dict)      # chunk index -> slot
    resolved: set[int] = field(default_factory=set)
    rejected: int = 0
    done: bool = False
    ended: float = 0.0           # clock() when it became done
    landed: set[int] = field(default_factory=set)                # chunks that arrived intact

    @property
    def arrived(self) -> int:
        return len(self.landed)


@dataclass
class ParkedAlloc:
    ident: bytes                                # the sender's control socket identity (to reply)
    sender_id: str
    msg: P.Alloc
    deadline: float                             # clock() after which it is refused
    arrived: float = 0.0
    also_held: frozenset[int] = frozenset()     # takeover: chunks the previous sender already delivered


class Parking:
    def __init__(self) -> None:
        self._queue: list[ParkedAlloc] = []

    def __len__(self) -> int:
        return len(self._queue)

    def park(self, p: ParkedAlloc) -> None:
        self._queue.append(p)

    def withdraw(self, sender_id: str, transfer_id: str) -> ParkedAlloc | None:
        """Take out ``sender_id``'s parked Alloc of ``transfer_id`` (None if there is none)."""
        for i, p in enumerate(self._queue):
            if p.sender_id == sender_id and p.msg.transfer_id == transfer_id:
                return self._queue.pop(i)
        return None

    def sweep(self, now: float, try_grant: Callable[[ParkedAlloc], bool],
              refuse: Callable[[ParkedAlloc], None]) -> None:
        """Offer each parked Alloc, oldest first, to ``try_grant`` (True: answered, it leaves
        the queue); one still unanswered at its deadline goes to ``refuse``."""
        still = []
        for p in self._queue:
            if try_grant(p):
                continue
            if now >= p.deadline:
                refuse(p)
            else:
                still.append(p)
        self._queue = still


class Tombstones:
    """Transfers that ended before (or without) being granted: aborted by the consumer, or
    dropped as orphans. A consumer that registers one later learns at once that it is dead,
    and an Alloc for it is refused - nobody waits out a deadline for a transfer already gone.
    Bounded: the oldest are forgotten first (a forgotten one costs a wait, never a wrong byte)."""

    def __init__(self, capacity: int = 8192) -> None:
        self._dead: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._dead)

    def bury(self, transfer_id: str, reason: str) -> None:
        self._dead[transfer_id] = reason
        self._dead.move_to_end(transfer_id)
        while len(self._dead) > self._capacity:
            self._dead.popitem(last=False)

    def why(self, transfer_id: str) -> str | None:
        """Why ``transfer_id`` is dead, or None if it is not known to be."""
        return self._dead.get(transfer_id)
