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

Three parts, one job each: :class:`Receiver` is the control server (the ZeroMQ ROUTER
socket, the handshake and sessions, liveness of senders) and the consumer's entry point;
:class:`~kvrelay.transport.transfers.TransferTable` holds grants, queues and housekeeping;
:class:`~kvrelay.transport.landing.Landing` takes the data plane's callbacks. The control
loop runs on one thread that owns the socket; data-plane callbacks come from backend
threads. Shared state sits behind the table's lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvrelay.common.errors import ProtocolError, TransportError
from kvrelay.common.listen import ListeningSocket
from kvrelay.common.secrets import load_secret
from kvrelay.transport import protocol as P
from kvrelay.transport.backends.base import ReceiverBackend, ReceiverHooks
from kvrelay.transport.config import TimeoutConfig, TransportConfig
from kvrelay.transport.events import ChunkArrival, Event, ReceiverStats, Refusal
from kvrelay.transport.landing import Landing
from kvrelay.transport.pool import HOST, Placement, ReceivePool
from kvrelay.transport.sessions import Gatekeeper, hello_refusal
from kvrelay.transport.transfers import TableParts, TransferTable

log = logging.getLogger(__name__)
_WARN_EVERY_S = 10.0
MAX_TRANSFER_ID = 256


class Receiver:
    """Owns the pool, the control socket and the receiving half of one backend."""

    def __init__(self, transport: TransportConfig, timeouts: TimeoutConfig, backend: ReceiverBackend,
                 fingerprint: bytes, *,
                 slot_bytes: int, consumer_wait_s: float = 0.0, verify_payload: bool = True,
                 clock: Callable[[], float] = time.monotonic, receiver_id: str | None = None,
                 secret: bytes | None = None, closing: Callable[[], str] | None = None,
                 placement: Placement = HOST) -> None:
        """``closing``: asked per Alloc; an answer (why) refuses it - the node is stopping (drain).
        ``consumer_wait_s``: an Alloc that arrives before the consumer called :meth:`expect`
        waits up to this long for it, so the held answer is what the consumer knows.
        ``placement``: where the pool's memory lives (host pages on a NUMA node, or a device)."""
        self.transport, self.timeouts, self._closing = transport, timeouts, closing
        self.backend = backend
        self.fingerprint = fingerprint
        self.receiver_id = receiver_id or f"recv-{uuid.uuid4().hex[:8]}"
        if placement.device is not None and not backend.writes_device_pool:
            raise TransportError(f"the {transport.backend.value} backend cannot write a pool in device memory "
                                 "(transport.pool_device gpu takes nixl)")
        self.pool = ReceivePool(int(transport.pool_bytes), slot_bytes, lease_s=timeouts.lease_s,
                                clock=clock, shared=backend.needs_shared_pool, placement=placement)
        self.stats = ReceiverStats()
        self._clock = clock
        self._warned: dict[Refusal, float] = {}        # cause -> when it was last logged
        self._warned_at: dict[Refusal, int] = {}       # cause -> its count then
        self.table = TransferTable(TableParts(self.pool, backend, self.stats, timeouts, clock, self._reply,
                                              self._refused, consumer_wait_s))
        self.landing = Landing(self.table, self._refused, self._seen, verify_payload)
        secret = load_secret(transport) if secret is None else secret
        self._gate = Gatekeeper(secret, timeouts.connect_s, self._refused, clock)
        self.data_mac = transport.data_signer(secret)     # the consumer checks it over what it installs
        self._peers: dict[str, float] = {}                          # sender id -> last seen
        try:
            self._control = ListeningSocket(zmq.ROUTER, "the control endpoint", transport.host, transport.control_port,
                                            {zmq.ROUTER_MANDATORY: 0, zmq.MAXMSGSIZE: transport.max_message_bytes + 4096})
        except TransportError:
            self.pool.close()
            raise
        self._sock, self.endpoint = self._control.sock, self._control.endpoint
        self._stop = threading.Event()
        self.backend.start(self.pool, ReceiverHooks(self.landing.deliver, self.landing.admit, self._peer_lost,
                                                    self.landing.chunk_failed, self._refused))
        self._thread = threading.Thread(target=self._loop, name="kvrelay-recv-ctl", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ consumer API
    def expect(self, transfer_id: str, held: Sequence[bytes] = ()) -> None:
        """Register a transfer before its Alloc arrives. ``held``: the keys of its leading
        chunks the consumer already holds (they are answered as held, never sent). Non-blocking."""
        self.table.expect(transfer_id, held)

    def next_event(self, transfer_id: str, timeout: float) -> Event:
        """Block for the transfer's next event. A returned ChunkArrival's slot is now held
        by the caller, who must :meth:`release` it. Raises TransferTimeout."""
        return self.table.next_event(transfer_id, timeout)

    def payload(self, arrival: ChunkArrival) -> Any:
        """The chunk's ``[layer][block]`` payload bytes inside the pool (zero-copy)."""
        return self.table.payload(arrival)

    def release(self, arrival: ChunkArrival) -> None:
        self.pool.release(arrival.slot)

    def finish(self, transfer_id: str) -> None:
        """The consumer is done with a transfer: drop its state and free anything unconsumed."""
        self.table.finish(transfer_id)

    def tracked(self) -> dict[str, int]:
        """How many entries each per-transfer map holds (all zero when nothing is in flight)."""
        return self.table.tracked()

    def landed(self) -> set[str]:
        """Transfers wholly here and intact, not yet finished by their consumer (any thread)."""
        return self.table.landed()

    def abort(self, transfer_id: str, reason: str = "aborted by consumer") -> None:
        """End the transfer now. One not granted yet is remembered as dead: its waiting consumer
        wakes at once, and its Alloc, parked or still to come, is refused."""
        self.table.abort(transfer_id, reason)

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
            self.table.sender_abort(sender, msg)
        return None

    def _refused(self, cause: Refusal, detail: str) -> None:
        """Count a refusal by cause (any thread); log it, at most once per cause every
        ``_WARN_EVERY_S`` (a flood of refusals must not become a flood of log lines)."""
        self.stats.refusals[cause.value] += 1
        if cause is Refusal.STALE:
            return
        now = self._clock()
        if now - self._warned.get(cause, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            since = self.stats.refusals[cause.value] - self._warned_at.get(cause, 0) - 1
            more = f" (and {since} more since the last one logged)" if since > 0 else ""
            self._warned[cause], self._warned_at[cause] = now, self.stats.refusals[cause.value]
            log.warning("refused (%s): %s%s", cause.value, detail, more)

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
            self._refused(Refusal.BAD_ALLOC, str(exc))
            return self._reply(ident, P.Refused(transfer_id=msg.transfer_id, reason=str(exc)))
        self.table.alloc(ident, sender, msg, self._closing() if self._closing is not None else "")
        return None

    # ------------------------------------------------------------------ senders' liveness
    def _seen(self, sender: str) -> None:
        self._peers[sender] = self._clock()

    def _peer_lost(self, sender: str, reason: str) -> None:
        with self.table.lock:
            self._gate.end(sender)
            if self._peers.pop(sender, None) is not None:
                self.backend.on_peer_gone(sender)
            self.table.fail_sender(sender, reason)

    def _housekeeping(self) -> None:
        now = self._clock()
        self.table.housekeeping(now)
        with self.table.lock:
            dead = [s for s, seen in self._peers.items() if now - seen > self.timeouts.peer_s]
        for sender in dead:
            self._peer_lost(sender, f"no heartbeat for {self.timeouts.peer_s:.3g}s")

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
