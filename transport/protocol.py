"""Control-plane messages (ZeroMQ ROUTER/DEALER, msgpack via msgspec).

Every message is a ``msgspec.Struct`` with named fields (never positional
frames), a ``type`` tag and a protocol version ``v``. :func:`decode` checks the
frame size, then the version, then the full schema; any failure raises
:class:`ProtocolError` with a reason the receiver sends back in an
:class:`Error` reply, so malformed input is answered, counted and survived.

Conversation (sender = prefill node P, receiver = decode node D)::

    P ─ Hello(fingerprint, backend, nonce, mac, info) ─▶ D     HMAC over a shared secret
    P ◀─ HelloAck(ok, reason, slot_bytes, info) ──────── D     info: backend endpoint data
    P ─ Alloc(transfer_id, keys, chunk_bytes, wait_s) ─▶ D     D skips keys it already holds
    P ◀─ Slots(transfer_id, grants, held) | Refused ──── D     back-pressure: D parks the Alloc
    P ═ data plane: write(chunk, slot) ═════════════════▶ D     (nixl / tcp / shm / ucx)
    P ─ Abort(transfer_id, reason) ─────────────────────▶ D     frees the transfer's slots
    P ─ Heartbeat(sender_id) ───────────────────────────▶ D     liveness, own socket
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from transport.errors import ErrorCode, ProtocolError

__all__ = ["ErrorCode", "ProtocolError"]   # re-exported: callers say P.ErrorCode

PROTOCOL_VERSION = 2                       # 2: ChunkDone removed (every backend reports arrival in band)
HELLO_CONTEXT = b"kvrelay-hello-v1"


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class Hello(_Msg, tag="hello", frozen=True):
    sender_id: str
    fingerprint: bytes        # Fingerprint.digest()
    backend: str              # TransportKind value
    nonce: bytes
    mac: bytes                # hmac_sha256(secret, HELLO_CONTEXT|sender|fp|backend|nonce)
    info: bytes = b""         # backend-specific (e.g. NIXL agent metadata)


class HelloAck(_Msg, tag="hello_ack", frozen=True):
    ok: bool
    reason: str = ""
    receiver_id: str = ""
    slot_bytes: int = 0
    info: bytes = b""


class Alloc(_Msg, tag="alloc", frozen=True):
    transfer_id: str
    keys: list[bytes]
    chunk_bytes: list[int]    # header + payload of each chunk
    wait_s: float = 5.0       # how long D may park this request when the pool is full


class Grant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    chunk_index: int
    slot: int
    generation: int
    offset: int               # byte offset of the slot inside D's pool


class Slots(_Msg, tag="slots", frozen=True):
    transfer_id: str
    grants: list[Grant]
    held: list[int] = []      # chunk indices D already holds: do not send them


class Refused(_Msg, tag="refused", frozen=True):
    transfer_id: str
    reason: str


class Abort(_Msg, tag="abort", frozen=True):
    transfer_id: str
    reason: str = ""


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    sender_id: str


class Bye(_Msg, tag="bye", frozen=True):
    sender_id: str


class Error(_Msg, tag="error", frozen=True):
    code: str
    reason: str


Message = Hello | HelloAck | Alloc | Slots | Refused | Abort | Heartbeat | Bye | Error


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


def hello_mac(secret: bytes, sender_id: str, fingerprint: bytes, backend: str, nonce: bytes) -> bytes:
    body = b"|".join([HELLO_CONTEXT, sender_id.encode(), fingerprint, backend.encode(), nonce])
    return hmac.new(secret, body, hashlib.sha256).digest()


def check_mac(secret: bytes, hello: Hello) -> bool:
    want = hello_mac(secret, hello.sender_id, hello.fingerprint, hello.backend, hello.nonce)
    return hmac.compare_digest(want, hello.mac)
