"""Control-plane messages (ZeroMQ ROUTER/DEALER, msgpack via msgspec).

Every message is a ``msgspec.Struct`` with named fields (never positional
frames), a ``type`` tag and a protocol version ``v``. :func:`decode` checks the
frame size, then the version, then the full schema; any failure raises
:class:`ProtocolError` with a reason the receiver sends back in an
:class:`Error` reply, so malformed input is answered, counted and survived.

Conversation (sender = prefill node P, receiver = decode node D)::

    P ─ Challenge(sender_id) ──────────────────────────▶ D
    P ◀─ ChallengeAck(challenge) ─────────────────────── D     a fresh single-use nonce
    P ─ Hello(fingerprint, backend, nonce, challenge, info, mac) ─▶ D
    P ◀─ HelloAck(ok, reason, slot_bytes, info, session, mac) ───── D
    P ─ Alloc(transfer_id, keys, chunk_bytes, wait_s) ─▶ D     sealed: session, seq, mac
    P ◀─ Slots(transfer_id, grants, held) | Refused ──── D     each grant carries the transfer's token
    P ═ data plane: write(chunk, slot, token) ═════════▶ D     (nixl / tcp / shm / ucx)
    P ─ Abort(transfer_id, reason) ─────────────────────▶ D     sealed; also withdraws a parked Alloc
    P ─ Heartbeat() ────────────────────────────────────▶ D     sealed, own socket and sequence
    P ─ Bye() ──────────────────────────────────────────▶ D     sealed

Authentication (the secret never travels; keys come from :mod:`kvrelay.common.secrets`):

* ``Hello.mac`` is an HMAC under the hello key over *every* field of the Hello (the
  protocol version, D's challenge and ``info`` included). D issued the challenge to this
  socket and accepts it once, so a replayed or altered Hello fails.
* ``HelloAck.mac`` covers every field of the answer and P's nonce: P knows the answer
  (and the NIXL metadata in its ``info``) came from a holder of the secret.
* Both sides derive a session key from the two nonces. Every later message from P is
  *sealed*: it names the session and a per-socket sequence number, and carries an HMAC
  under the session key. D attributes a message to the session's sender, never to a
  name inside the message, and drops a replay (a sequence number not above the last).
"""

from __future__ import annotations

import msgspec

from kvrelay.common.errors import ErrorCode, ProtocolError
from kvrelay.common.keys import KEY_BYTES
from kvrelay.common.secrets import mac, same
from kvrelay.common.wire import HEADER_SIZE

__all__ = ["ErrorCode", "ProtocolError"]   # re-exported: callers say P.ErrorCode

PROTOCOL_VERSION = 3     # 2: ChunkDone removed; 3: challenge-response Hello, sealed messages, grant tokens


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class Challenge(_Msg, tag="challenge", frozen=True):
    sender_id: str


class ChallengeAck(_Msg, tag="challenge_ack", frozen=True):
    challenge: bytes          # single use, for the socket that asked


class Hello(_Msg, tag="hello", frozen=True, kw_only=True):
    sender_id: str
    fingerprint: bytes        # Fingerprint.digest()
    backend: str              # TransportKind value
    nonce: bytes              # P's, for the answer's MAC and the session key
    challenge: bytes          # D's, echoed
    info: bytes = b""         # backend-specific (e.g. NIXL agent metadata)
    mac: bytes = b""          # HMAC(hello key, every other field)


class HelloAck(_Msg, tag="hello_ack", frozen=True, kw_only=True):
    ok: bool
    reason: str = ""
    receiver_id: str = ""
    slot_bytes: int = 0
    info: bytes = b""
    session: bytes = b""      # names the session in sealed messages
    mac: bytes = b""          # HMAC(hello key, P's nonce + every other field); empty when not ok


class _Sealed(_Msg, frozen=True, kw_only=True):
    """A message from an authenticated sender: bound to its session, ordered, MAC'd."""

    session: bytes = b""
    seq: int = 0
    mac: bytes = b""


class Alloc(_Sealed, tag="alloc", frozen=True, kw_only=True):
    transfer_id: str
    keys: list[bytes]
    chunk_bytes: list[int]    # header + payload of each chunk
    wait_s: float = 5.0       # how long D may park this request when the pool is full
    early: bool = False       # D's consumer registers only after the push starts (first token from P): no wait


class Grant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    chunk_index: int
    slot: int
    generation: int
    offset: int               # byte offset of the slot inside D's pool
    token: bytes = b""        # the transfer's unguessable token: every write must present it


class Slots(_Msg, tag="slots", frozen=True):
    transfer_id: str
    grants: list[Grant]
    held: list[int] = []      # chunk indices D already holds: do not send them


class Refused(_Msg, tag="refused", frozen=True):
    transfer_id: str
    reason: str


class Abort(_Sealed, tag="abort", frozen=True, kw_only=True):
    transfer_id: str
    reason: str = ""


class Heartbeat(_Sealed, tag="heartbeat", frozen=True, kw_only=True):
    channel: int = 1          # heartbeats have their own socket, so their own sequence


class Bye(_Sealed, tag="bye", frozen=True, kw_only=True):
    pass


class Error(_Msg, tag="error", frozen=True):
    code: str
    reason: str


Message = Challenge | ChallengeAck | Hello | HelloAck | Alloc | Slots | Refused | Abort | Heartbeat | Bye | Error
Sealed = Alloc | Abort | Heartbeat | Bye


class _Probe(msgspec.Struct):
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_probe = msgspec.msgpack.Decoder(_Probe)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int) -> Message:
    """Decode one frame; raise :class:`ProtocolError` (with its ``code``) on anything wrong."""
    if len(frame) > max_bytes:
        raise ProtocolError(code=ErrorCode.OVERSIZE, reason=f"frame of {len(frame)} bytes exceeds limit {max_bytes}")
    try:
        version = _probe.decode(frame).v
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(code=ErrorCode.MALFORMED, reason=f"not a kvrelay control message: {exc}") from exc
    if version == -1:
        raise ProtocolError(code=ErrorCode.VERSION, reason="message has no protocol version field `v`")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(code=ErrorCode.VERSION,
                            reason=f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})")
    try:
        return _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(code=ErrorCode.MALFORMED, reason=f"invalid message: {exc}") from exc


def _unsigned(msg: Message) -> bytes:
    return encode(msgspec.structs.replace(msg, mac=b""))


def sign_hello(key: bytes, hello: Hello) -> Hello:
    return msgspec.structs.replace(hello, mac=mac(key, b"hello", _unsigned(hello)))


def check_hello(key: bytes, hello: Hello) -> bool:
    return same(mac(key, b"hello", _unsigned(hello)), hello.mac)


def sign_ack(key: bytes, nonce: bytes, ack: HelloAck) -> HelloAck:
    return msgspec.structs.replace(ack, mac=mac(key, b"ack", nonce, _unsigned(ack)))


def check_ack(key: bytes, nonce: bytes, ack: HelloAck) -> bool:
    return same(mac(key, b"ack", nonce, _unsigned(ack)), ack.mac)


def session_key(key: bytes, hello: Hello, session: bytes) -> bytes:
    """The session's key: both nonces, the sender and the session id, under the session key."""
    return mac(key, hello.challenge, hello.nonce, hello.sender_id.encode(), session)


def data_token(session_key: bytes) -> bytes:
    """What the sender's data connection presents (tcp/shm), once."""
    return mac(session_key, b"data-connection")


def seal(key: bytes, session: bytes, seq: int, msg: Sealed) -> Sealed:
    msg = msgspec.structs.replace(msg, session=session, seq=seq, mac=b"")
    return msgspec.structs.replace(msg, mac=mac(key, b"sealed", encode(msg)))


def check_seal(key: bytes, msg: Sealed) -> bool:
    return same(mac(key, b"sealed", _unsigned(msg)), msg.mac)


def check_alloc(msg: Alloc, slot_bytes: int, max_transfer_id: int) -> None:
    """Raise ProtocolError (INVALID) unless ``msg`` asks for chunks a ``slot_bytes`` slot can hold."""
    if not msg.transfer_id or len(msg.transfer_id) > max_transfer_id:
        raise ProtocolError(f"transfer_id must be 1..{max_transfer_id} characters", ErrorCode.INVALID)
    if len(msg.keys) != len(msg.chunk_bytes) or not msg.keys:
        raise ProtocolError("keys and chunk_bytes must be non-empty and equally long", ErrorCode.INVALID)
    for i, (k, n) in enumerate(zip(msg.keys, msg.chunk_bytes, strict=True)):
        if len(k) != KEY_BYTES:
            raise ProtocolError(f"key {i} is {len(k)} bytes, expected {KEY_BYTES}", ErrorCode.INVALID)
        if not HEADER_SIZE < n <= slot_bytes:
            raise ProtocolError(f"chunk {i} of {n} bytes does not fit a {slot_bytes}-byte slot", ErrorCode.INVALID)
