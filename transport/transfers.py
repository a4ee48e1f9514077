"""The receiver's transfer table: grants, the consumers' queues and housekeeping.

One :class:`TransferTable` per receiver holds every transfer the decode node knows of:

* **grants** - an authenticated Alloc becomes a :class:`GrantedTransfer` with a slot for
  each chunk the consumer does not already hold (:meth:`TransferTable.alloc`), or parks
  while the pool is full or its consumer has not registered yet; a retry from another
  sender takes over a live transfer (:meth:`_take_over`);
* **queues** - the consumer registers a transfer (:meth:`expect`), takes its events
  (:meth:`next_event`) in completion order, releases each slot and :meth:`finish`\\es it;
* **ends** - :meth:`fail` (an abort, a dead sender), :meth:`maybe_done`, and a
  tombstone for a transfer that died before its grant, so neither its consumer nor its
  Alloc waits out a deadline;
* **housekeeping** - parked Allocs granted or refused, expired leases rejected, transfers
  no consumer ever registered dropped (:meth:`housekeeping`, on the control thread).

Thread-safety: every method takes ``lock`` (re-entrant); the data-plane callbacks
(:mod:`kvrelay.transport.landing`) take it too. Replies to senders go out through the
``reply`` callable the control server passes in; nothing here touches a socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.common.errors import TransferTimeout, TransportError
from kvrelay.common.polling import poll_queue, wait_queue
from kvrelay.common.wire import transfer_tag
from kvrelay.transport import protocol as P
from kvrelay.transport.backends.base import ReceiverBackend
from kvrelay.transport.config import TimeoutConfig
from kvrelay.transport.events import (
    ChunkArrival,
    ChunkRejected,
    Event,
    FailReason,
    ReceiverStats,
    Refusal,
    TransferDone,
    TransferFailed,
)
from kvrelay.transport.ledger import GrantedTransfer, ParkedAlloc, Parking, Tombstones
from kvrelay.transport.pool import ReceivePool, SlotRef

log = logging.getLogger("kvrelay.transport.receiver")
TOKEN_BYTES = 16

ReplyFn = Callable[[bytes, P.Message], None]
RefusedFn = Callable[[Refusal, str], None]


@dataclass(frozen=True)
class TableParts:
    """What a table works with: the pool, the backend, the counters and the deadlines."""

    pool: ReceivePool
    backend: ReceiverBackend
    stats: ReceiverStats
    timeouts: TimeoutConfig
    clock: Callable[[], float]
    reply: ReplyFn                 # answer a sender's control socket identity (Slots, Refused)
    refused: RefusedFn             # count a refusal by cause
    consumer_wait_s: float = 0.0   # an Alloc before expect() waits this long for it (0: grant at once)


class TransferTable:
    """Every transfer the receiver knows of, and what each consumer waits for."""

    def __init__(self, parts: TableParts) -> None:
        self.parts = parts
        self.pool, self.stats, self._clock = parts.pool, parts.stats, parts.clock
        self.lock = threading.RLock()
        self.transfers: dict[str, GrantedTransfer] = {}
        self.by_tag: dict[bytes, str] = {}
        self._queues: dict[str, queue.SimpleQueue[Event]] = {}
        self._held: dict[str, tuple[bytes, ...]] = {}              # transfer -> keys the consumer holds
        self._consumers: set[str] = set()                          # transfers a consumer registered
        self.parked = Parking()                                    # Allocs waiting for slots or a consumer
        self._dead = Tombstones()                                  # ended before a grant

    # ------------------------------------------------------------------ consumer side
    def expect(self, transfer_id: str, held: Sequence[bytes] = ()) -> None:
        """Register a transfer before its Alloc arrives. ``held``: the keys of its leading
        chunks the consumer already holds (they are answered as held, never sent). Non-blocking."""
        with self.lock:
            q = self._queues.setdefault(transfer_id, queue.SimpleQueue())
            self._consumers.add(transfer_id)
            if held:
                self._held[transfer_id] = tuple(held)
            if (why := self._dead.why(transfer_id)) is not None:      # it died before we got here
                q.put(TransferFailed(transfer_id, FailReason.ABORTED, why))

    def next_event(self, transfer_id: str, timeout: float) -> Event:
        """Block for the transfer's next event. A returned ChunkArrival's slot is now held
        by the caller, who must :meth:`release` it. Raises TransferTimeout."""
        with self.lock:
            q = self._queues.setdefault(transfer_id, queue.SimpleQueue())
            self._consumers.add(transfer_id)
        backend = self.parts.backend
        ev = poll_queue(q, backend.progress, timeout) if backend.poll_driven else wait_queue(q, timeout)
        if ev is None:
            raise TransferTimeout(f"no event for transfer {transfer_id!r} in {timeout:.3g}s")
        if isinstance(ev, ChunkArrival):
            try:
                self.pool.take(ev.slot)
            except TransportError as exc:   # lease expired between arrival and take
                return ChunkRejected(transfer_id, ev.chunk_index, FailReason.LEASE_EXPIRED, str(exc))
        return ev

    def payload(self, arrival: ChunkArrival) -> Any:
        """The chunk's ``[layer][block]`` payload inside the pool (zero-copy): a memoryview of
        host pages, or a uint8 tensor of device memory."""
        return self.pool.payload(arrival.slot, arrival.header.payload_len)

    def finish(self, transfer_id: str) -> None:
        """The consumer is done with a transfer: drop its state and free anything unconsumed."""
        with self.lock:
            self._end(transfer_id)
            self._consumers.discard(transfer_id)
            q = self._queues.pop(transfer_id, None)
        while q is not None and not q.empty():
            ev = q.get_nowait()
            if isinstance(ev, ChunkArrival):
                with contextlib.suppress(TransportError):
                    self.pool.release(ev.slot)

    def landed(self) -> set[str]:
        """Transfers whose every granted chunk arrived intact and that no consumer has finished:
        their consumer can install them now, without waiting on the network."""
        with self.lock:
            return {tid for tid, t in self.transfers.items() if t.done and len(t.landed) == len(t.slots)}

    def tracked(self) -> dict[str, int]:
        """How many entries each per-transfer map holds (all zero when nothing is in flight)."""
        with self.lock:
            return {"transfers": len(self.transfers), "queues": len(self._queues), "tags": len(self.by_tag),
                    "held": len(self._held), "consumers": len(self._consumers), "pending": len(self.parked)}

    def abort(self, transfer_id: str, reason: str) -> None:
        """End the transfer now. One not granted yet is remembered as dead: its waiting consumer
        wakes at once, and its Alloc, parked or still to come, is refused."""
        with self.lock:
            if transfer_id in self.transfers:
                self.fail(transfer_id, FailReason.ABORTED, reason)
                return
            self._dead.bury(transfer_id, reason)
            if transfer_id in self._queues:
                self._queues[transfer_id].put(TransferFailed(transfer_id, FailReason.ABORTED, reason))

    # ------------------------------------------------------------------ senders' requests
    def alloc(self, ident: bytes, sender: str, msg: P.Alloc, closing: str = "") -> None:
        """An authenticated, well-formed Alloc: grant it, park it, or refuse it (``closing``: why
        the node takes no new transfer). A transfer already active is refused per transfer."""
        also_held: frozenset[int] = frozenset()
        with self.lock:
            t = self.transfers.get(msg.transfer_id)
            if t is not None:
                if t.sender_id == sender or t.done or list(msg.keys) != t.keys:
                    reason = f"transfer {msg.transfer_id!r} already active"
                    self.parts.refused(Refusal.BAD_ALLOC, reason)
                    return self.parts.reply(ident, P.Refused(transfer_id=msg.transfer_id, reason=reason))
                also_held = self._take_over(t, sender)
        wait = min(msg.wait_s, self.parts.timeouts.alloc_wait_s)
        now = self._clock()
        pending = ParkedAlloc(ident, sender, msg, now + max(wait, 0.0), now, also_held)
        if closing:
            self._refuse(pending, closing)
        elif not self._try_grant(pending):
            self.stats.alloc_parked += 1
            self.parked.park(pending)
        return None

    def sender_abort(self, sender: str, msg: P.Abort) -> None:
        """The sender gives up: a parked Alloc leaves the queue before it takes a slot; a granted
        transfer's unfilled slots are freed. Either way its consumer sees TransferFailed."""
        reason = msg.reason or "aborted by sender"
        if self.parked.withdraw(sender, msg.transfer_id) is not None:
            self.stats.aborts += 1
            self._notify(msg.transfer_id, TransferFailed(msg.transfer_id, FailReason.ABORTED, reason))
            return
        with self.lock:
            t = self.transfers.get(msg.transfer_id)
            if t is None:                                 # already ended (e.g. refused just before)
                self.parts.refused(Refusal.STALE, f"Abort of {msg.transfer_id!r} from {sender!r}")
            elif t.sender_id != sender:                   # e.g. a sender that was taken over
                self.stats.foreign_aborts += 1
                self.parts.refused(Refusal.FOREIGN, f"Abort of {msg.transfer_id!r} from {sender!r}")
            else:
                self.stats.aborts += 1
                self.fail(msg.transfer_id, FailReason.ABORTED, reason)

    def fail_sender(self, sender: str, reason: str) -> None:
        """``sender`` is gone: every transfer it still owes fails (PEER_DEAD)."""
        with self.lock:
            victims = [tid for tid, t in self.transfers.items() if t.sender_id == sender and not t.done]
            if victims:
                self.stats.peers_dead += 1
            for tid in victims:
                self.fail(tid, FailReason.PEER_DEAD, f"sender {sender!r} lost: {reason}")

    def _try_grant(self, p: ParkedAlloc) -> bool:
        """Answer ``p`` now if it can be (granted, or refused for good); False leaves it parked."""
        msg = p.msg
        with self.lock:
            dead = self._dead.why(msg.transfer_id)
        if dead is not None:                          # aborted before it was granted
            self._refuse(p, f"transfer {msg.transfer_id!r} was aborted: {dead}")
            return True
        wait_s = self.parts.consumer_wait_s
        if wait_s and not msg.early and msg.transfer_id not in self._consumers and self._clock() < p.arrived + wait_s:
            return False                            # the consumer has not registered it yet
        with self.lock:
            mine = self._held.get(msg.transfer_id, ())
        held_flags = [(i < len(mine) and key == mine[i]) or i in p.also_held for i, key in enumerate(msg.keys)]
        want = [i for i, h in enumerate(held_flags) if not h]
        try:
            refs = self.pool.try_allocate(len(want), msg.transfer_id)
        except TransportError as exc:                 # more chunks than the pool has slots
            self._refuse(p, str(exc))
            return True
        if refs is None:
            return False
        self._grant(p, want, refs, tuple(i for i, h in enumerate(held_flags) if h))
        return True

    def _grant(self, p: ParkedAlloc, want: list[int], refs: list[SlotRef], held: tuple[int, ...]) -> None:
        msg = p.msg
        t = GrantedTransfer(msg.transfer_id, p.sender_id, list(msg.keys), held, transfer_tag(msg.transfer_id),
                            os.urandom(TOKEN_BYTES))
        with self.lock:
            for i, ref in zip(want, refs, strict=True):
                t.slots[i] = ref
            self.transfers[msg.transfer_id] = t
            self.by_tag[t.tag] = msg.transfer_id
            self._queues.setdefault(msg.transfer_id, queue.SimpleQueue())
        self.parts.backend.on_grants(p.sender_id, msg.transfer_id, [(i, t.slots[i]) for i in want], t.token)
        grants = [P.Grant(chunk_index=i, slot=r.index, generation=r.generation, offset=self.pool.offset(r),
                          token=t.token) for i, r in zip(want, refs, strict=True)]
        self.parts.reply(p.ident, P.Slots(transfer_id=msg.transfer_id, grants=grants, held=list(held)))
        if not want:
            with self.lock:
                self.maybe_done(t)

    def _take_over(self, t: GrantedTransfer, sender: str) -> frozenset[int]:
        """Another sender allocates a live transfer with the same keys: the router retried the
        prefill on another node after the first failed. The first sender's unfilled slots are
        freed (quarantined: its writes may still land), what it delivered stays, and the new
        sender is granted the rest; the consumer sees one transfer. Lock held."""
        log.warning("transfer %r: %r takes over from %r (%d chunks already delivered)", t.transfer_id, sender,
                    t.sender_id, len(t.landed))
        self.stats.takeovers += 1
        self.pool.release_owner(t.transfer_id, include_filled=False)
        self.transfers.pop(t.transfer_id, None)
        self.by_tag.pop(t.tag, None)
        self.parts.backend.on_release(t.sender_id, t.transfer_id)
        return frozenset(t.landed | set(t.held))

    def _refuse(self, p: ParkedAlloc, reason: str) -> None:
        self.stats.alloc_refused += 1
        self.parts.reply(p.ident, P.Refused(transfer_id=p.msg.transfer_id, reason=reason))
        self._notify(p.msg.transfer_id, TransferFailed(p.msg.transfer_id, FailReason.POOL_FULL, reason))

    def _refuse_late(self, p: ParkedAlloc) -> None:
        self._refuse(p, f"receive pool full: {len(p.msg.keys)} chunks did not fit "
                        f"within {p.msg.wait_s:.3g}s ({self.pool.stats().free} slots free)")

    def _notify(self, transfer_id: str, ev: TransferFailed) -> None:
        """Tell a registered consumer of a transfer that never got slots."""
        with self.lock:
            q = self._queues.get(transfer_id)
        if q is not None:
            q.put(ev)

    # ------------------------------------------------------------------ lookups and ends (lock held)
    def current(self, t: GrantedTransfer) -> bool:
        """``t`` is still the live record of its transfer."""
        return self.transfers.get(t.transfer_id) is t

    def awaiting(self, tag: bytes, chunk_index: int, ref: SlotRef) -> GrantedTransfer | None:
        """The live transfer still waiting for ``chunk_index`` in slot ``ref``, or None (a stale,
        misrouted or repeated report: counted)."""
        tid = self.by_tag.get(tag)
        t = self.transfers.get(tid) if tid is not None else None
        if t is None or t.slots.get(chunk_index) != ref or chunk_index in t.resolved:
            self.stats.stale_writes += 1
            return None
        return t

    def publish(self, transfer_id: str, ev: Event) -> None:
        """Queue ``ev`` for the consumer. A transfer the consumer already finished has no queue:
        an arrival's slot is then released, anything else dropped."""
        q = self._queues.get(transfer_id)
        if q is not None:
            q.put(ev)
        elif isinstance(ev, ChunkArrival):
            with contextlib.suppress(TransportError):
                self.pool.release(ev.slot)

    def maybe_done(self, t: GrantedTransfer) -> None:
        if not t.done and len(t.resolved) == len(t.slots):
            t.done, t.ended = True, self._clock()
            self.publish(t.transfer_id, TransferDone(t.transfer_id, t.arrived, t.rejected, t.held))
            self.parts.backend.on_release(t.sender_id, t.transfer_id)

    def fail(self, transfer_id: str, reason: FailReason, detail: str) -> None:
        t = self.transfers.get(transfer_id)
        if t is None or t.done:
            return
        t.done, t.ended = True, self._clock()
        freed = self.pool.release_owner(transfer_id, include_filled=False)
        log.warning("transfer %r failed (%s): %s; %d slots freed", transfer_id, reason.value, detail, freed)
        self.publish(transfer_id, TransferFailed(transfer_id, reason, detail))
        self.parts.backend.on_release(t.sender_id, transfer_id)

    def _end(self, transfer_id: str) -> None:
        self._held.pop(transfer_id, None)
        t = self.transfers.pop(transfer_id, None)
        if t is None:
            return
        self.by_tag.pop(transfer_tag(transfer_id), None)
        if not t.done:
            t.done = True
            self.parts.backend.on_release(t.sender_id, transfer_id)
        self.pool.release_owner(transfer_id)

    # ------------------------------------------------------------------ housekeeping (control thread)
    def housekeeping(self, now: float) -> None:
        self.parked.sweep(now, self._try_grant, self._refuse_late)
        for ref, owner, _state in self.pool.reap_expired():
            with self.lock:
                t = self.transfers.get(owner)
                chunk = next((i for i, r in t.slots.items() if r == ref), None) if t else None
                if t is not None and chunk is not None and chunk not in t.resolved:
                    t.resolved.add(chunk)
                    t.rejected += 1
                    self.publish(owner, ChunkRejected(owner, chunk, FailReason.LEASE_EXPIRED,
                                                      f"slot {ref.index} lease expired"))
                    self.maybe_done(t)
        self._drop_orphans(now)

    def _drop_orphans(self, now: float) -> None:
        """A transfer no consumer ever registered (D rejected its request, or never scheduled
        it) is dropped ``lease_s`` after it ended, with every slot it still holds."""
        lease_s = self.parts.timeouts.lease_s
        with self.lock:
            orphans = [tid for tid, t in self.transfers.items()
                       if t.done and tid not in self._consumers and now - t.ended > lease_s]
        for tid in orphans:
            log.info("dropping transfer %r: no consumer registered it", tid)
            self.stats.orphans_dropped += 1
            self.finish(tid)
            with self.lock:
                self._dead.bury(tid, f"dropped: no consumer registered it within {lease_s:.3g}s")
