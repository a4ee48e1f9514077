"""The prefill node's side of the transport: handshake, slot allocation, chunk pushes.

Typical use (one Sender per decode node)::

    sender = Sender(cfg.transport, cfg.timeouts, endpoint, make_sender_backend(cfg.transport), fp.digest())
    sender.connect()                                    # Hello -> HelloAck, data path open
    alloc = sender.alloc("req-1", keys, chunk_bytes)     # may wait (back-pressure)
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

from transport import protocol as P
from transport.backends.base import (
    BlockPayload,
    Buffer,
    Payload,
    SenderBackend,
    SourceLayout,
    WriteHandle,
    WriteState,
    host_buffers,
)
from transport.config import TimeoutConfig, TransportConfig
from transport.errors import (
    HandshakeError,
    PeerDeadError,
    PoolFullError,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from transport.secrets import KeyUse, derive_key, load_secret
from transport.wire import HEADER_SIZE, DType, make_header

log = logging.getLogger(__name__)


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
        self._session, self._key, self._seq = b"", b"", 0
        self.layout: SourceLayout | None = None
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._socket(self.sender_id)
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False

    def _socket(self, identity: str) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, identity.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    # ------------------------------------------------------------------ control plane
    def _request(self, msg: P.Message, want: type, ref: str, timeout: float) -> P.Message:
        self._sock.send(P.encode(msg))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1):
                raise PeerDeadError(f"receiver {self.endpoint} did not answer {type(msg).__name__} "
                                    f"within {timeout:.3g}s")
            reply = P.decode(self._sock.recv(), self.transport.max_message_bytes)
            if isinstance(reply, P.Error):
                code = P.ErrorCode(reply.code) if reply.code in P.ErrorCode._value2member_map_ else P.ErrorCode.INVALID
                raise ProtocolError(f"receiver rejected {type(msg).__name__}: [{reply.code}] {reply.reason}", code)
            if isinstance(reply, want | P.Refused) and getattr(reply, "transfer_id", ref) == ref:
                return reply
            log.debug("dropping unrelated reply %s", type(reply).__name__)

    def connect(self) -> None:
        """Challenge, Hello, open the data path. Raises HandshakeError with the receiver's reason."""
        challenge = self._request(P.Challenge(sender_id=self.sender_id), P.ChallengeAck, "", self.timeouts.connect_s)
        assert isinstance(challenge, P.ChallengeAck)
        hello = P.sign_hello(self._hello_key, P.Hello(
            sender_id=self.sender_id, fingerprint=self.fingerprint, backend=self.transport.backend.value,
            nonce=os.urandom(32), challenge=challenge.challenge, info=self.backend.local_info(self.sender_id)))
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
        wait = self.timeouts.alloc_wait_s if wait_s is None else wait_s
        msg = self._sealed(P.Alloc(transfer_id=transfer_id, keys=list(keys), chunk_bytes=list(chunk_bytes),
                                   wait_s=wait, early=early))
        reply = self._request(msg, P.Slots, transfer_id, wait + self.timeouts.connect_s)
        if isinstance(reply, P.Refused):
            raise PoolFullError(f"receiver refused transfer {transfer_id!r}: {reply.reason}")
        assert isinstance(reply, P.Slots)
        return Allocation(transfer_id, list(keys), {g.chunk_index: g for g in reply.grants}, list(reply.held))

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
                                 num_layers=num_layers, num_blocks=num_blocks, dtype=dtype).pack()
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

    def push(self, transfer_id: str, keys: Sequence[bytes], chunks: Sequence[Sequence[Buffer]]) -> Allocation:
        """Allocate and push whole chunks (each a list of regions); waits for completion."""
        sizes = [HEADER_SIZE + sum(memoryview(r).nbytes for r in c) for c in chunks]
        alloc = self.alloc(transfer_id, keys, sizes)
        for i, regions in enumerate(chunks):
            self.write_chunk(alloc, i, regions)
        self.wait_all(alloc)
        return alloc

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
