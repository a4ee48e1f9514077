"""The decode node's side of the transport: control server + receive pool + data plane.

Lifecycle of one transfer on the receiver (decode node D)::

    1. A sender asks for a challenge, then says Hello; the Hello's MAC (over every
       field and the single-use challenge), fingerprint and backend pass; D answers with
       its backend's connection info and a session (HelloAck, MAC'd for the sender).
       Every later message must be sealed with the session's key, in order; anything
       else is refused and counted by cause (``ReceiverStats.refusals``).
    2. The consumer registers the transfer with ``expect(transfer_id, held)``:
       ``held`` are the leading chunk keys it already holds *for this transfer*
       (its own prefix-cache hit). Alloc(transfer_id, keys) arrives; chunks whose
       key matches ``held`` are answered as held and never sent, the rest get
       slots. An Alloc that comes before ``expect`` waits up to
       ``consumer_wait_s`` for it. If the pool is full the Alloc is parked
       (back-pressure) until slots free up or ``wait_s`` passes, then Refused.
    3. The data plane reports each chunk as its bytes complete (``_deliver``):
       D verifies header, routing and checksum, then publishes a ChunkArrival on
       the transfer's queue - in completion order, while later chunks are still
       in flight. A bad chunk is freed and published as ChunkRejected. A write that
       does not come from the transfer's sender with its grant token is refused
       without touching the transfer (``_admit``).
    4. The consumer (``next_event``) takes each arrival, installs it, and
       ``release``s the slot. When every chunk is resolved, TransferDone follows.
    5. Abort, an expired lease or a dead sender (heartbeat silence or a broken
       data connection) frees the transfer's unfilled slots and publishes
       ChunkRejected / TransferFailed; an Abort of a parked Alloc withdraws it before
       it takes a slot. Nothing leaks and nothing hangs.

The control loop runs on one thread that owns the ZeroMQ ROUTER socket; data
plane callbacks come from backend threads. Shared state sits behind one lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import zmq
from kvrelay.common.errors import (
    ChecksumError,
    ChunkError,
    MisroutedChunk,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from kvrelay.common.listen import ListeningSocket
from kvrelay.common.polling import poll_queue, wait_queue
from kvrelay.common.secrets import load_secret, same
from kvrelay.common.wire import HEADER_SIZE, transfer_tag, verify_chunk
from kvrelay.transport import protocol as P
from kvrelay.transport.backends.base import ReceiverBackend, ReceiverHooks
from kvrelay.transport.config import TimeoutConfig, TransportConfig
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
from kvrelay.transport.sessions import Gatekeeper, hello_refusal

log = logging.getLogger(__name__)
MAX_TRANSFER_ID = 256
TOKEN_BYTES = 16


class Receiver:
    """Owns the pool, the control socket and the receiving half of one backend."""

    def __init__(self, transport: TransportConfig, timeouts: TimeoutConfig, backend: ReceiverBackend,
                 fingerprint: bytes, *,
                 slot_bytes: int, consumer_wait_s: float = 0.0, verify_payload: bool = True,
                 clock: Callable[[], float] = time.monotonic, receiver_id: str | None = None,
                 secret: bytes | None = None, closing: Callable[[], str] | None = None) -> None:
        """``closing``: asked per Alloc; an answer (why) refuses it - the node is stopping (drain)."""
        self.transport, self.timeouts, self._closing = transport, timeouts, closing
        self.backend = backend
        self.fingerprint = fingerprint
        self.receiver_id = receiver_id or f"recv-{uuid.uuid4().hex[:8]}"
        self.pool = ReceivePool(int(transport.pool_bytes), slot_bytes, lease_s=timeouts.lease_s,
                                clock=clock, shared=backend.needs_shared_pool)
        self.stats = ReceiverStats()
        self._clock = clock
        # False: a payload no backend hashed as it landed is left to the consumer, which hashes the
        # exact bytes it installs (a late stale write cannot slip in between a check and the install).
        self._verify_payload = verify_payload
        self._held: dict[str, tuple[bytes, ...]] = {}              # transfer -> keys the consumer holds
        self._consumers: set[str] = set()                          # transfers a consumer registered
        # An Alloc that arrives before the consumer called expect() waits up to this long for
        # it, so the held answer is what the consumer knows (0 = grant at once).
        self._consumer_wait_s = consumer_wait_s
        secret = load_secret(transport) if secret is None else secret
        self._gate = Gatekeeper(secret, timeouts.connect_s, self._refused, clock)
        self._lock = threading.RLock()
        self._transfers: dict[str, GrantedTransfer] = {}
        self._by_tag: dict[bytes, str] = {}
        self._queues: dict[str, queue.SimpleQueue[Event]] = {}
        self._peers: dict[str, float] = {}                          # sender id -> last seen
        self._parked = Parking()                                    # Allocs waiting for slots or a consumer
        self._dead = Tombstones()                                   # ended before a grant (lock held)
        try:
            self._control = ListeningSocket(zmq.ROUTER, "the control endpoint", transport.host, transport.control_port,
                                            {zmq.ROUTER_MANDATORY: 0, zmq.MAXMSGSIZE: transport.max_message_bytes + 4096})
        except TransportError:
            self.pool.close()
            raise
        self._sock, self.endpoint = self._control.sock, self._control.endpoint
        self._stop = threading.Event()
        self.backend.start(self.pool, ReceiverHooks(self._deliver, self._admit, self._peer_lost,
                                                    self._chunk_failed, self._refused))
        self._thread = threading.Thread(target=self._loop, name="kvrelay-recv-ctl", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ consumer API
    def expect(self, transfer_id: str, held: Sequence[bytes] = ()) -> None:
        """Register a transfer before its Alloc arrives. ``held``: the keys of its leading
        chunks the consumer already holds (they are answered as held, never sent). Non-blocking."""
        with self._lock:
            q = self._queues.setdefault(transfer_id, queue.SimpleQueue())
            self._consumers.add(transfer_id)
            if held:
                self._held[transfer_id] = tuple(held)
            if (why := self._dead.why(transfer_id)) is not None:      # it died before we got here
                q.put(TransferFailed(transfer_id, FailReason.ABORTED, why))

    def next_event(self, transfer_id: str, timeout: float) -> Event:
        """Block for the transfer's next event. A returned ChunkArrival's slot is now held
        by the caller, who must :meth:`release` it. Raises TransferTimeout."""
        with self._lock:
            q = self._queues.setdefault(transfer_id, queue.SimpleQueue())
            self._consumers.add(transfer_id)
        ev = poll_queue(q, self.backend.progress, timeout) if self.backend.poll_driven else wait_queue(q, timeout)
        if ev is None:
            raise TransferTimeout(f"no event for transfer {transfer_id!r} in {timeout:.3g}s")
        if isinstance(ev, ChunkArrival):
            try:
                self.pool.take(ev.slot)
            except TransportError as exc:   # lease expired between arrival and take
                return ChunkRejected(transfer_id, ev.chunk_index, FailReason.LEASE_EXPIRED, str(exc))
        return ev

    def payload(self, arrival: ChunkArrival) -> memoryview:
        """The chunk's ``[layer][block]`` payload bytes inside the pool (zero-copy)."""
        off = self.pool.offset(arrival.slot) + HEADER_SIZE
        return self.pool.arena.buf[off:off + arrival.header.payload_len]

    def release(self, arrival: ChunkArrival) -> None:
        self.pool.release(arrival.slot)

    def finish(self, transfer_id: str) -> None:
        """The consumer is done with a transfer: drop its state and free anything unconsumed."""
        with self._lock:
            self._end_transfer(transfer_id)
            self._consumers.discard(transfer_id)
            q = self._queues.pop(transfer_id, None)
        while q is not None and not q.empty():
            ev = q.get_nowait()
            if isinstance(ev, ChunkArrival):
                with contextlib.suppress(TransportError):
                    self.pool.release(ev.slot)

    def tracked(self) -> dict[str, int]:
        """How many entries each per-transfer map holds (all zero when nothing is in flight)."""
        with self._lock:
            return {"transfers": len(self._transfers), "queues": len(self._queues), "tags": len(self._by_tag),
                    "held": len(self._held), "consumers": len(self._consumers), "pending": len(self._parked)}

    def abort(self, transfer_id: str, reason: str = "aborted by consumer") -> None:
        """End the transfer now. One not granted yet is remembered as dead: its waiting consumer
        wakes at once, and its Alloc, parked or still to come, is refused."""
        with self._lock:
            if transfer_id in self._transfers:
                self._fail_transfer(transfer_id, FailReason.ABORTED, reason)
                return
            self._dead.bury(transfer_id, reason)
            if transfer_id in self._queues:
                self._queues[transfer_id].put(TransferFailed(transfer_id, FailReason.ABORTED, reason))

    # ------------------------------------------------------------------ control loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(timeout=20))
                if self._sock in ready:
                    for _ in range(64):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self._housekeeping()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.error("control loop error: %s", exc)
            except Exception:  # noqa: BLE001 - a bug must not end the control plane while /health says 200
                self.stats.internal_errors += 1
                log.exception("control loop: internal error (the receiver keeps serving)")

    def _on_frames(self, frames: list[bytes]) -> None:
        self.stats.messages += 1
        if len(frames) != 2:
            self.stats.malformed += 1
            if frames:
                self._reply(frames[0], P.Error(code=P.ErrorCode.MALFORMED.value,
                                               reason=f"expected 1 frame, got {len(frames) - 1}"))
            return
        ident, body = frames
        try:
            msg = P.decode(body, self.transport.max_message_bytes)
            self._dispatch(ident, msg)
        except ProtocolError as exc:
            self.stats.malformed += 1
            code = exc.code
            log.info("rejected control frame (%s): %s", code.value, exc)
            self._reply(ident, P.Error(code=code.value, reason=str(exc)))

    def _reply(self, ident: bytes, msg: P.Message) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)

    def _dispatch(self, ident: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Challenge):
            return self._reply(ident, P.ChallengeAck(challenge=self._gate.challenge(ident)))
        if isinstance(msg, P.Hello):
            return self._on_hello(ident, msg)
        if not isinstance(msg, P.Alloc | P.Abort | P.Heartbeat | P.Bye):
            raise _invalid(P.ErrorCode.INVALID, f"{type(msg).__name__} is not a request")
        try:
            sender = self._gate.sender_of(msg)
        except ProtocolError:
            self.stats.unauthenticated += 1
            raise
        if isinstance(msg, P.Bye):
            self._end_session(sender)
            return None
        self._peers[sender] = self._clock()
        if isinstance(msg, P.Alloc):
            self._on_alloc(ident, sender, msg)
        elif isinstance(msg, P.Abort):
            self._on_abort(sender, msg)
        return None

    def _on_abort(self, sender: str, msg: P.Abort) -> None:
        """The sender gives up: a parked Alloc leaves the queue before it takes a slot; a granted
        transfer's unfilled slots are freed. Either way its consumer sees TransferFailed."""
        reason = msg.reason or "aborted by sender"
        if self._parked.withdraw(sender, msg.transfer_id) is not None:
            self.stats.aborts += 1
            self._notify(msg.transfer_id, TransferFailed(msg.transfer_id, FailReason.ABORTED, reason))
            return
        with self._lock:
            t = self._transfers.get(msg.transfer_id)
            if t is None:                                 # already ended (e.g. refused just before)
                self._refused(Refusal.STALE, f"Abort of {msg.transfer_id!r} from {sender!r}")
            elif t.sender_id != sender:                   # e.g. a sender that was taken over
                self.stats.foreign_aborts += 1
                self._refused(Refusal.FOREIGN, f"Abort of {msg.transfer_id!r} from {sender!r}")
            else:
                self.stats.aborts += 1
                self._fail_transfer(msg.transfer_id, FailReason.ABORTED, reason)

    def _refused(self, cause: Refusal, detail: str) -> None:
        """Count a refusal by cause (any thread)."""
        self.stats.refusals[cause.value] += 1
        if cause is not Refusal.STALE:
            log.warning("refused (%s): %s", cause.value, detail)

    def _on_hello(self, ident: bytes, hello: P.Hello) -> None:
        reason = hello_refusal(self._gate, ident, hello, self.fingerprint, self.transport.backend.value)
        if reason.startswith("authentication failed"):
            self.stats.unauthenticated += 1
        if reason:
            log.warning("refused Hello from %r: %s", hello.sender_id, reason)
            self._reply(ident, P.HelloAck(ok=False, reason=reason, receiver_id=self.receiver_id))
            return
        session, key = self._gate.open_session(hello)
        try:
            self.backend.on_hello(hello.sender_id, hello.info, P.data_token(key))
        except TransportError as exc:
            self._gate.end(hello.sender_id)
            self._reply(ident, P.HelloAck(ok=False, reason=f"backend refused: {exc}"))
            return
        self._peers[hello.sender_id] = self._clock()
        ack = P.HelloAck(ok=True, receiver_id=self.receiver_id, slot_bytes=self.pool.slot_bytes,
                         info=self.backend.info(), session=session)
        self._reply(ident, P.sign_ack(self._gate.hello_key, hello.nonce, ack))

    def _end_session(self, sender: str) -> None:
        """The sender said Bye (authenticated): forget it and its backend state."""
        self._gate.end(sender)
        if self._peers.pop(sender, None) is not None:
            self.backend.on_peer_gone(sender)

    def _on_alloc(self, ident: bytes, sender: str, msg: P.Alloc) -> None:
        """An authenticated Alloc. What is wrong with *this transfer* (an id too long, a transfer
        already active, chunks no slot holds) is answered per transfer - Refused - and never
        ends the sender's session: its other transfers go on."""
        try:
            P.check_alloc(msg, self.pool.slot_bytes, MAX_TRANSFER_ID)
        except ProtocolError as exc:
            return self._refuse_alloc(ident, msg, str(exc))
        also_held: frozenset[int] = frozenset()
        with self._lock:
            t = self._transfers.get(msg.transfer_id)
            if t is not None:
                if t.sender_id == sender or t.done or list(msg.keys) != t.keys:
                    return self._refuse_alloc(ident, msg, f"transfer {msg.transfer_id!r} already active")
                also_held = self._take_over(t, sender)
        wait = min(msg.wait_s, self.timeouts.alloc_wait_s)
        now = self._clock()
        pending = ParkedAlloc(ident, sender, msg, now + max(wait, 0.0), now, also_held)
        if why := (self._closing() if self._closing is not None else ""):
            self._refuse(pending, why)
        elif not self._try_grant(pending):
            self.stats.alloc_parked += 1
            self._parked.park(pending)

    def _refuse_alloc(self, ident: bytes, msg: P.Alloc, reason: str) -> None:
        self._refused(Refusal.BAD_ALLOC, reason)
        self._reply(ident, P.Refused(transfer_id=msg.transfer_id, reason=reason))

    def _try_grant(self, p: ParkedAlloc) -> bool:
        msg = p.msg
        with self._lock:
            dead = self._dead.why(msg.transfer_id)
        if dead is not None:                          # aborted before it was granted
            self._refuse(p, f"transfer {msg.transfer_id!r} was aborted: {dead}")
            return True
        if (self._consumer_wait_s and not msg.early and msg.transfer_id not in self._consumers
                and self._clock() < p.arrived + self._consumer_wait_s):
            return False                            # the consumer has not registered it yet
        with self._lock:
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
        held = tuple(i for i, h in enumerate(held_flags) if h)
        t = GrantedTransfer(msg.transfer_id, p.sender_id, list(msg.keys), held, transfer_tag(msg.transfer_id),
                      os.urandom(TOKEN_BYTES))
        with self._lock:
            for i, ref in zip(want, refs, strict=True):
                t.slots[i] = ref
            self._transfers[msg.transfer_id] = t
            self._by_tag[t.tag] = msg.transfer_id
            self._queues.setdefault(msg.transfer_id, queue.SimpleQueue())
        self.backend.on_grants(p.sender_id, msg.transfer_id, [(i, t.slots[i]) for i in want], t.token)
        grants = [P.Grant(chunk_index=i, slot=r.index, generation=r.generation, offset=self.pool.offset(r),
                          token=t.token) for i, r in zip(want, refs, strict=True)]
        self._reply(p.ident, P.Slots(transfer_id=msg.transfer_id, grants=grants, held=list(held)))
        if not want:
            with self._lock:
                self._maybe_done(t)
        return True

    def _take_over(self, t: GrantedTransfer, sender: str) -> frozenset[int]:
        """Another sender allocates a live transfer with the same keys: the router retried the
        prefill on another node after the first failed. The first sender's unfilled slots are
        freed (quarantined: its writes may still land), what it delivered stays, and the new
        sender is granted the rest; the consumer sees one transfer. Lock held."""
        log.warning("transfer %r: %r takes over from %r (%d chunks already delivered)", t.transfer_id, sender,
                    t.sender_id, len(t.landed))
        self.stats.takeovers += 1
        self.pool.release_owner(t.transfer_id, include_filled=False)
        self._transfers.pop(t.transfer_id, None)
        self._by_tag.pop(t.tag, None)
        self.backend.on_release(t.sender_id, t.transfer_id)
        return frozenset(t.landed | set(t.held))

    def _refuse(self, p: ParkedAlloc, reason: str) -> None:
        self.stats.alloc_refused += 1
        self._reply(p.ident, P.Refused(transfer_id=p.msg.transfer_id, reason=reason))
        self._notify(p.msg.transfer_id, TransferFailed(p.msg.transfer_id, FailReason.POOL_FULL, reason))

    def _refuse_late(self, p: ParkedAlloc) -> None:
        self._refuse(p, f"receive pool full: {len(p.msg.keys)} chunks did not fit "
                        f"within {p.msg.wait_s:.3g}s ({self.pool.stats().free} slots free)")

    def _notify(self, transfer_id: str, ev: TransferFailed) -> None:
        """Tell a registered consumer of a transfer that never got slots."""
        with self._lock:
            q = self._queues.get(transfer_id)
        if q is not None:
            q.put(ev)

    # ------------------------------------------------------------------ data-plane callbacks
    def _admit(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes) -> Refusal | None:
        """May this write touch its slot? None if it comes from the transfer's sender with its
        grant token, for a slot still waiting for that chunk; else the refusal (counted). Any thread."""
        with self._lock:
            t = self._awaiting(tag, chunk_index, ref)
            cause = (Refusal.STALE if t is None else Refusal.FOREIGN if t.sender_id != sender
                     else None if same(token, t.token) else Refusal.BAD_TOKEN)
        if cause is Refusal.FOREIGN:
            self.stats.misrouted += 1
        if cause is not None:
            self._refused(cause, f"write of chunk {chunk_index} into slot {ref.index} from {sender!r}")
        return cause

    def _deliver(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes,
                 payload_sum: int | None = None) -> None:
        """A backend says the bytes of ``chunk_index`` are complete in ``ref``. Any thread."""
        if self._admit(sender, tag, chunk_index, ref, token) is not None:
            return
        with self._lock:
            t = self._awaiting(tag, chunk_index, ref)
            if t is None:                                 # resolved since _admit looked
                return
            key = t.keys[chunk_index]
            self._peers[sender] = self._clock()
        try:
            hdr = verify_chunk(self.pool.view(ref), tag=t.tag, key=key, chunk_index=chunk_index,
                               payload_sum=payload_sum, check_payload=self._verify_payload)
        except ChunkError as exc:
            self._reject(t, chunk_index, exc)
            return
        t_arr = time.monotonic()
        with self._lock:
            if not self._current(t):                      # finished or failed while we verified
                self.stats.stale_writes += 1
                return
            try:
                self.pool.mark_filled(ref)
            except TransportError as exc:                 # reclaimed while we verified
                self._reject(t, chunk_index, exc)
                return
            t.resolved.add(chunk_index)
            t.landed.add(chunk_index)
            self.stats.chunks_arrived += 1
            self.stats.bytes_arrived += hdr.total_len
            verified = payload_sum is not None or self._verify_payload
            self._publish(t.transfer_id, ChunkArrival(t.transfer_id, chunk_index, key, ref, hdr, t_arr, verified))
            self._maybe_done(t)

    def _current(self, t: GrantedTransfer) -> bool:
        """``t`` is still the live record of its transfer (lock held)."""
        return self._transfers.get(t.transfer_id) is t

    def _publish(self, transfer_id: str, ev: Event) -> None:
        """Queue ``ev`` for the consumer (lock held). A transfer the consumer already finished
        has no queue: an arrival's slot is then released, anything else dropped."""
        q = self._queues.get(transfer_id)
        if q is not None:
            q.put(ev)
        elif isinstance(ev, ChunkArrival):
            with contextlib.suppress(TransportError):
                self.pool.release(ev.slot)

    def _chunk_failed(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, reason: str) -> None:
        """A backend's receive of ``chunk_index`` failed in the library: reject it now. Any thread."""
        with self._lock:
            t = self._awaiting(tag, chunk_index, ref)
        if t is not None:
            self._reject(t, chunk_index, ChunkError(f"receive failed: {reason}"))

    def _awaiting(self, tag: bytes, chunk_index: int, ref: SlotRef) -> GrantedTransfer | None:
        """The live transfer still waiting for ``chunk_index`` in slot ``ref``, or None (a stale,
        misrouted or repeated report: counted). Lock held."""
        tid = self._by_tag.get(tag)
        t = self._transfers.get(tid) if tid is not None else None
        if t is None or t.slots.get(chunk_index) != ref or chunk_index in t.resolved:
            self.stats.stale_writes += 1
            return None
        return t

    def _reject(self, t: GrantedTransfer, chunk_index: int, exc: TransportError) -> None:
        reason = FailReason.CHECKSUM if isinstance(exc, ChecksumError) else FailReason.INVALID_CHUNK
        if isinstance(exc, ChecksumError):
            self.stats.checksum_failures += 1
        elif isinstance(exc, MisroutedChunk):
            self.stats.misrouted += 1
        log.warning("rejected chunk %d of %r: %s", chunk_index, t.transfer_id, exc)
        with self._lock:
            if not self._current(t):
                self.stats.stale_writes += 1
                return
            self.stats.chunks_rejected += 1
            ref = t.slots.get(chunk_index)
            if ref is not None and chunk_index not in t.resolved:
                with contextlib.suppress(TransportError):
                    self.pool.release(ref)
            t.resolved.add(chunk_index)
            t.rejected += 1
            self._publish(t.transfer_id, ChunkRejected(t.transfer_id, chunk_index, reason, str(exc)))
            self._maybe_done(t)

    def _peer_lost(self, sender: str, reason: str) -> None:
        with self._lock:
            self._gate.end(sender)
            if self._peers.pop(sender, None) is not None:
                self.backend.on_peer_gone(sender)
            victims = [tid for tid, t in self._transfers.items() if t.sender_id == sender and not t.done]
            if victims:
                self.stats.peers_dead += 1
            for tid in victims:
                self._fail_transfer(tid, FailReason.PEER_DEAD, f"sender {sender!r} lost: {reason}")

    # ------------------------------------------------------------------ bookkeeping (lock held)
    def _maybe_done(self, t: GrantedTransfer) -> None:
        if not t.done and len(t.resolved) == len(t.slots):
            t.done, t.ended = True, self._clock()
            self._publish(t.transfer_id, TransferDone(t.transfer_id, t.arrived, t.rejected, t.held))
            self.backend.on_release(t.sender_id, t.transfer_id)

    def _fail_transfer(self, transfer_id: str, reason: FailReason, detail: str) -> None:
        t = self._transfers.get(transfer_id)
        if t is None or t.done:
            return
        t.done, t.ended = True, self._clock()
        freed = self.pool.release_owner(transfer_id, include_filled=False)
        log.warning("transfer %r failed (%s): %s; %d slots freed", transfer_id, reason.value, detail, freed)
        self._publish(transfer_id, TransferFailed(transfer_id, reason, detail))
        self.backend.on_release(t.sender_id, transfer_id)

    def _end_transfer(self, transfer_id: str) -> None:
        self._held.pop(transfer_id, None)
        t = self._transfers.pop(transfer_id, None)
        if t is None:
            return
        self._by_tag.pop(transfer_tag(transfer_id), None)
        if not t.done:
            t.done = True
            self.backend.on_release(t.sender_id, transfer_id)
        self.pool.release_owner(transfer_id)

    def _housekeeping(self) -> None:
        now = self._clock()
        self._parked.sweep(now, self._try_grant, self._refuse_late)
        for ref, owner, _state in self.pool.reap_expired():
            with self._lock:
                t = self._transfers.get(owner)
                chunk = next((i for i, r in t.slots.items() if r == ref), None) if t else None
                if t is not None and chunk is not None and chunk not in t.resolved:
                    t.resolved.add(chunk)
                    t.rejected += 1
                    self._publish(owner, ChunkRejected(owner, chunk, FailReason.LEASE_EXPIRED,
                                                          f"slot {ref.index} lease expired"))
                    self._maybe_done(t)
        self._drop_orphans(now)
        with self._lock:
            dead = [s for s, seen in self._peers.items() if now - seen > self.timeouts.peer_s]
        for sender in dead:
            self._peer_lost(sender, f"no heartbeat for {self.timeouts.peer_s:.3g}s")

    def _drop_orphans(self, now: float) -> None:
        """A transfer no consumer ever registered (D rejected its request, or never scheduled
        it) is dropped ``lease_s`` after it ended, with every slot it still holds."""
        with self._lock:
            orphans = [tid for tid, t in self._transfers.items()
                       if t.done and tid not in self._consumers and now - t.ended > self.timeouts.lease_s]
        for tid in orphans:
            log.info("dropping transfer %r: no consumer registered it", tid)
            self.stats.orphans_dropped += 1
            self.finish(tid)
            with self._lock:
                self._dead.bury(tid, f"dropped: no consumer registered it within {self.timeouts.lease_s:.3g}s")

    def close(self) -> None:
        """Stop the control loop and free everything. Blocks until the control endpoint is
        unbound: a new receiver can bind the same port as soon as this returns."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._control.close()
        self.backend.close()
        self.pool.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _invalid(code: P.ErrorCode, reason: str) -> ProtocolError:
    return ProtocolError(reason, code)
