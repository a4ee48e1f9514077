"""The prefill node's side of the transport: handshake, slot allocation, chunk pushes.

Typical use (one Sender per decode node)::

    sender = Sender(cfg.transport, cfg.timeouts, endpoint, make_sender_backend(cfg.transport), fp.digest())
    sender.connect()                                    # Hello -> HelloAck, data path open
    alloc = sender.alloc("req-1", keys, chunk_bytes)     # may wait (back-pressure); or, never blocking:
    pending = sender.alloc_async("req-2", keys, chunk_bytes)
    alloc2 = sender.poll_alloc(pending)                  # None while D parks it; call again later
    for i, regions in chunks:                            # as each chunk's KV is saved
        h = sender.write_chunk(alloc, i, regions, num_layers=L, num_blocks=B)
    sender.wait_all(handles)                             # or poll them
    sender.close()

The Sender is used from one thread (its DEALER socket is not thread-safe); its
heartbeat thread owns a second socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from kvrelay.common.errors import (
    HandshakeError,
    PeerDeadError,
    PoolFullError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from kvrelay.common.secrets import KeyUse, derive_key, load_secret
from kvrelay.common.wire import HEADER_SIZE, DType, make_header
from kvrelay.transport import protocol as P
from kvrelay.transport.backends.base import (
    BlockPayload,
    Payload,
    SenderBackend,
    SourceLayout,
    WriteHandle,
    WriteState,
    host_buffers,
)
from kvrelay.transport.config import TimeoutConfig, TransportConfig

log = logging.getLogger(__name__)


@dataclass
class PendingAlloc:
    """An Alloc sent and not answered yet (:meth:`Sender.alloc_async`)."""

    transfer_id: str
    keys: list[bytes]
    deadline: float                # monotonic; no answer by then: the receiver is taken for dead
    sent: float = field(default_factory=time.monotonic)


@dataclass
class Allocation:
    transfer_id: str
    keys: list[bytes]
    grants: dict[int, P.Grant]
    held: list[int]
    handles: list[WriteHandle] = field(default_factory=list)


class Sender:
    def __init__(self, transport: TransportConfig, timeouts: TimeoutConfig, endpoint: str,
                 backend: SenderBackend, fingerprint: bytes, *, sender_id: str | None = None,
                 secret: bytes | None = None) -> None:
        self.transport, self.timeouts = transport, timeouts
        self.endpoint = endpoint
        self.backend = backend
        self.fingerprint = fingerprint
        self.sender_id = sender_id or f"send-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slot_bytes = 0
        self.receiver_id = ""
        secret = load_secret(transport) if secret is None else secret
        self._hello_key, self._session_root = derive_key(secret, KeyUse.HELLO), derive_key(secret, KeyUse.SESSION)
        self.data_mac = transport.data_signer(secret)     # signs the headers write_chunk builds itself
        self._session, self._key, self._seq = b"", b"", 0
        self.layout: SourceLayout | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._socket(self.sender_id)
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False
        self._replies: dict[str, P.Message] = {}      # control replies by transfer id ("" = handshake)
        self._abandoned: set[str] = set()             # transfer ids whose push gave up on its Alloc
        self._failure: ProtocolError | None = None    # D rejected this session (an Error reply)

    def _socket(self, identity: str) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, identity.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    # ------------------------------------------------------------------ control plane
    def _request(self, msg: P.Message, want: type, ref: str, timeout: float) -> P.Message:
        """Send ``msg`` and block for its reply (``ref``: the transfer id it names, "" for none)."""
        self._sock.send(P.encode(msg))
        deadline = time.monotonic() + timeout
        while (reply := self._replies.pop(ref, None)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerDeadError(f"receiver {self.endpoint} did not answer {type(msg).__name__} "
                                    f"within {timeout:.3g}s")
            self.wait_replies(remaining)
        if not isinstance(reply, want | P.Refused):
            raise ProtocolError(f"receiver answered {type(msg).__name__} with {type(reply).__name__}",
                                P.ErrorCode.INVALID)
        return reply

    def wait_replies(self, timeout: float) -> None:
        """Take in the control replies that arrived, waiting up to ``timeout`` for the first.
        Replies are kept by transfer id until asked for; an ``Error`` (the session is not
        good any more) fails every later request on this Sender."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise PeerDeadError(f"sender to {self.endpoint} is closed")
        wait_ms = max(0, int(timeout * 1000))
        while self._sock.poll(wait_ms):
            wait_ms = 0
            reply = P.decode(self._sock.recv(), self.transport.max_message_bytes)
            if isinstance(reply, P.Error):
                code = P.ErrorCode(reply.code) if reply.code in P.ErrorCode._value2member_map_ else P.ErrorCode.INVALID
                self._failure = ProtocolError(f"receiver rejected a request: [{reply.code}] {reply.reason}", code)
                raise self._failure
            ref = getattr(reply, "transfer_id", "")
            if ref in self._abandoned:               # its push gave up (and aborted) while D parked the Alloc
                self._abandoned.discard(ref)
                continue
            self._replies[ref] = reply

    def connect(self) -> None:
        """Challenge, Hello, open the data path. Raises HandshakeError with the receiver's reason.
        The backend's local info (for NIXL: the process agent, created on first use - seconds on
        a loaded host) is made before the Challenge, so the Hello answers it well within its TTL."""
        info = self.backend.local_info(self.sender_id)
        challenge = self._request(P.Challenge(sender_id=self.sender_id), P.ChallengeAck, "", self.timeouts.connect_s)
        assert isinstance(challenge, P.ChallengeAck)
        hello = P.sign_hello(self._hello_key, P.Hello(
            sender_id=self.sender_id, fingerprint=self.fingerprint, backend=self.transport.backend.value,
            nonce=os.urandom(32), challenge=challenge.challenge, info=info))
        ack = self._request(hello, P.HelloAck, "", self.timeouts.connect_s)
        assert isinstance(ack, P.HelloAck)
        if not ack.ok:
            raise HandshakeError(f"receiver {self.endpoint} refused Hello: {ack.reason}")
        if not P.check_ack(self._hello_key, hello.nonce, ack):
            raise HandshakeError(f"receiver {self.endpoint} answered Hello without proof of the shared secret")
        self.slot_bytes, self.receiver_id = ack.slot_bytes, ack.receiver_id
        self._session, self._key = ack.session, P.session_key(self._session_root, hello, ack.session)
        self.backend.connect(self.sender_id, ack.info, ack.slot_bytes, P.data_token(self._key))
        self._hb_thread = threading.Thread(target=self._heartbeat, name="kvrelay-send-hb", daemon=True)
        self._hb_thread.start()

    def _sealed(self, msg: P.Sealed) -> P.Sealed:
        """``msg`` bound to this session with the next sequence number (control socket only)."""
        self._seq += 1
        return P.seal(self._key, self._session, self._seq, msg)

    def _heartbeat(self) -> None:
        sock = self._socket(f"{self.sender_id}/hb")
        seq = 0
        try:
            while not self._hb_stop.wait(self.timeouts.heartbeat_s):
                seq += 1
                msg = P.encode(P.seal(self._key, self._session, seq, P.Heartbeat(channel=1)))
                with contextlib.suppress(zmq.Again):
                    sock.send(msg, zmq.NOBLOCK)
        finally:
            sock.close(linger=0)

    def alloc(self, transfer_id: str, keys: Sequence[bytes], chunk_bytes: Sequence[int],
              wait_s: float | None = None, early: bool = False) -> Allocation:
        """Ask for slots. Blocks while the receiver applies back-pressure; PoolFullError if refused.
        ``early``: the receiver's consumer will register after the push starts, so D grants at
        once instead of waiting for it (it then cannot skip chunks the consumer holds)."""
        pending = self.alloc_async(transfer_id, keys, chunk_bytes, wait_s, early)
        while (alloc := self.poll_alloc(pending)) is None:
            self.wait_replies(max(0.0, pending.deadline - time.monotonic()))
        return alloc

    def alloc_async(self, transfer_id: str, keys: Sequence[bytes], chunk_bytes: Sequence[int],
                    wait_s: float | None = None, early: bool = False) -> PendingAlloc:
        """Send the Alloc and return at once; :meth:`poll_alloc` collects the answer. Several
        may be outstanding: D parks each under back-pressure, and one waiting for slots (or
        for D's consumer) does not hold up the writes of transfers already granted."""
        wait = float(self.timeouts.alloc_wait_s if wait_s is None else wait_s)   # the MAC covers its encoding
        if self._failure is not None:
            raise self._failure
        msg = self._sealed(P.Alloc(transfer_id=transfer_id, keys=list(keys), chunk_bytes=list(chunk_bytes),
                                   wait_s=wait, early=early))
        self._replies.pop(transfer_id, None)
        self._abandoned.discard(transfer_id)
        self._sock.send(P.encode(msg))
        return PendingAlloc(transfer_id, list(keys), time.monotonic() + wait + self.timeouts.connect_s)

    def poll_alloc(self, pending: PendingAlloc) -> Allocation | None:
        """The Alloc's answer if it came (non-blocking): an Allocation, PoolFullError if D
        refused, PeerDeadError once D is past the deadline, ProtocolError if D rejected the
        session. None while D still parks it."""
        self.wait_replies(0)
        reply = self._replies.pop(pending.transfer_id, None)
        if reply is None:
            if time.monotonic() > pending.deadline:
                self.abandon(pending)
                raise PeerDeadError(f"receiver {self.endpoint} did not answer Alloc of {pending.transfer_id!r} "
                                    f"within {pending.deadline - pending.sent:.3g}s")
            return None
        if isinstance(reply, P.Refused):
            raise PoolFullError(f"receiver refused transfer {pending.transfer_id!r}: {reply.reason}")
        if not isinstance(reply, P.Slots):
            raise ProtocolError(f"receiver answered Alloc with {type(reply).__name__}", P.ErrorCode.INVALID)
        return Allocation(pending.transfer_id, pending.keys, {g.chunk_index: g for g in reply.grants},
                          list(reply.held))

    def abandon(self, pending: PendingAlloc) -> None:
        """The push gave up on an Alloc: an Abort goes out at once (non-blocking). D drops the
        Alloc if it still parks it, or frees the slots if it granted them meanwhile (the Abort
        follows the Alloc on one ordered socket, so one of the two holds); a late answer is dropped."""
        if pending.transfer_id in self._abandoned:
            return                                   # given up on already (poll_alloc's deadline)
        if self._replies.pop(pending.transfer_id, None) is None:
            self._abandoned.add(pending.transfer_id)
        self.abort(pending.transfer_id, "the push gave up on its slots")

    def abort(self, transfer_id: str, reason: str = "") -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(P.encode(self._sealed(P.Abort(transfer_id=transfer_id, reason=reason))), zmq.NOBLOCK)

    # ------------------------------------------------------------------ data plane
    def register_layout(self, layout: SourceLayout) -> None:
        """Register the paged KV cache with a ``registered_layout`` backend (once per Sender;
        the backend shares the registration process-wide). Later writes may name blocks."""
        self.backend.register_layout(layout)
        self.layout = layout

    def _payload_bytes(self, payload: Payload) -> int:
        if isinstance(payload, BlockPayload):
            if self.layout is None:
                raise TransportError("a BlockPayload needs register_layout first")
            return self.layout.payload_bytes(payload)
        return sum(memoryview(r).nbytes for r in payload)

    def write_chunk(self, alloc: Allocation, chunk_index: int, payload: Payload, *,
                    num_layers: int = 1, num_blocks: int = 1, dtype: DType = DType.OPAQUE,
                    header: bytes | None = None) -> WriteHandle | None:
        """Post one chunk. Returns None if the receiver already holds it.

        ``payload`` is host buffers, or blocks of the registered layout (:class:`BlockPayload`).
        ``header`` may be passed pre-built (``make_header(...).pack()``) when the producer
        computed the checksum while gathering; it is required for a BlockPayload.
        """
        grant = alloc.grants.get(chunk_index)
        if grant is None:
            if chunk_index in alloc.held:
                return None
            raise TransportError(f"chunk {chunk_index} of {alloc.transfer_id!r} has no slot")
        if header is None:
            header = make_header(alloc.keys[chunk_index], alloc.transfer_id, chunk_index, host_buffers(payload),
                                 num_layers=num_layers, num_blocks=num_blocks, dtype=dtype, mac=self.data_mac).pack()
        nbytes = HEADER_SIZE + self._payload_bytes(payload)
        if nbytes > self.slot_bytes:
            raise TransportError(f"chunk {chunk_index} is {nbytes} bytes; slots hold {self.slot_bytes}")
        handle = self.backend.write(alloc.transfer_id, chunk_index, header, payload, grant)
        alloc.handles.append(handle)
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        return self.backend.poll(handle)

    def cancel(self, handle: WriteHandle) -> None:
        """Give up on a write in flight (its transfer failed); see ``SenderBackend.cancel``."""
        self.backend.cancel(handle)

    def wait(self, handle: WriteHandle, timeout: float | None = None) -> None:
        t = self.timeouts.chunk_s if timeout is None else timeout
        state = self.backend.wait(handle, t)
        if state is WriteState.FAILED:
            raise TransportError(f"write of chunk {handle.chunk_index} failed: {handle.error}")
        if state is not WriteState.DONE:
            raise TransferTimeout(f"write of chunk {handle.chunk_index} not done after {t:.3g}s")

    def wait_all(self, alloc: Allocation, timeout: float | None = None) -> None:
        for h in alloc.handles:
            self.wait(h, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        with contextlib.suppress(zmq.ZMQError):
            if self._key:
                self._sock.send(P.encode(self._sealed(P.Bye())), zmq.NOBLOCK)
        self._sock.close(linger=100)
        self.backend.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
