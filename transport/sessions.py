"""The decode node's gatekeeper: challenges, authenticated Hellos and sessions.

Contract (see :mod:`kvrelay.transport.protocol` for the messages):

* :meth:`Gatekeeper.challenge` issues a fresh challenge to a socket identity; it is good
  for one Hello from that identity within ``ttl_s``. Challenges are stateless cookies
  (``expiry | random | HMAC(D's own key, identity | expiry | random)``): issuing one stores
  nothing, so no flood of requests for challenges can push out an honest sender's.
* :meth:`Gatekeeper.authenticate` checks a Hello's challenge (its cookie MAC, its identity,
  unexpired, unused) and the Hello's MAC; it returns the refusal or None. Only a challenge
  answered by a valid Hello is remembered as used, until it expires: that memory grows with
  authenticated senders, never with unauthenticated traffic.
* :meth:`Gatekeeper.open_session` makes the session a successful Hello starts (replacing
  that sender's previous one) and returns the signed HelloAck fields' session id and key.
* :meth:`Gatekeeper.sender_of` attributes a sealed message to its session's sender, or
  raises :class:`ProtocolError` (``UNAUTHENTICATED``): unknown session, bad MAC, or a
  sequence number not above the last on its channel.

Every refusal is reported through ``refused(cause, detail)``. Not thread-safe: the
receiver's control thread owns it (``end`` may be called under the receiver's lock).
"""

from __future__ import annotations

import collections
import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.common.errors import ErrorCode, ProtocolError
from kvrelay.common.secrets import KeyUse, derive_key, mac
from kvrelay.transport import protocol as P
from kvrelay.transport.events import Refusal

COOKIE_TAG = 16                 # bytes of the cookie's HMAC kept


@dataclass
class Session:
    sender_id: str
    key: bytes
    seq: dict[int, int] = field(default_factory=dict)     # channel -> last sequence number seen


class Gatekeeper:
    def __init__(self, secret: bytes, ttl_s: float, refused: Callable[[Refusal, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hello_key, self._root = derive_key(secret, KeyUse.HELLO), derive_key(secret, KeyUse.SESSION)
        self._ttl, self._refused, self._clock = ttl_s, refused, clock
        self._cookie_key = os.urandom(32)                 # this process's: challenges come back to it
        self._used: collections.OrderedDict[bytes, float] = collections.OrderedDict()   # answered -> expiry
        self._sessions: dict[bytes, Session] = {}         # session id -> its sender
        self._session_of: dict[str, bytes] = {}          # sender id -> its current session
        self.failures = 0                                 # refused Hellos and sealed messages

    def challenge(self, ident: bytes) -> bytes:
        """A cookie for ``ident``: expiry (8 bytes, ms of the clock) | random (16) | tag (16)."""
        head = int((self._clock() + self._ttl) * 1000).to_bytes(8, "big") + os.urandom(16)
        return head + mac(self._cookie_key, ident, head)[:COOKIE_TAG]

    def _cookie_expiry(self, ident: bytes, challenge: bytes) -> float | None:
        """The expiry of a challenge this gatekeeper issued to ``ident``; None if it did not."""
        head, tag = challenge[:-COOKIE_TAG], challenge[-COOKIE_TAG:]
        if len(head) != 24 or not hmac.compare_digest(tag, mac(self._cookie_key, ident, head)[:COOKIE_TAG]):
            return None
        return int.from_bytes(head[:8], "big") / 1000

    def authenticate(self, ident: bytes, hello: P.Hello) -> str | None:
        """None if ``hello`` answers a live challenge issued to ``ident`` under the secret."""
        now = self._clock()
        while self._used and next(iter(self._used.values())) < now:     # expired: refused by the cookie
            self._used.popitem(last=False)
        expiry = self._cookie_expiry(ident, hello.challenge)
        if expiry is None or now > expiry or hello.challenge in self._used:
            self._fail(Refusal.REPLAY, f"Hello from {hello.sender_id!r} with an unknown, used or expired challenge")
            return "authentication failed: unknown, used or expired challenge (a replayed Hello?)"
        if not P.check_hello(self.hello_key, hello):
            self._fail(Refusal.BAD_MAC, f"Hello from {hello.sender_id!r} with a bad MAC")
            return "authentication failed: HMAC over the shared secret does not match"
        self._used[hello.challenge] = expiry
        return None

    def open_session(self, hello: P.Hello) -> tuple[bytes, bytes]:
        """``(session id, session key)`` for an authenticated Hello; the sender's old session ends."""
        session = os.urandom(16)
        key = P.session_key(self._root, hello, session)
        self.end(hello.sender_id)
        self._sessions[session], self._session_of[hello.sender_id] = Session(hello.sender_id, key), session
        return session, key

    def sender_of(self, msg: P.Sealed) -> str:
        session = self._sessions.get(msg.session)
        if session is None:
            raise self._unauthenticated(Refusal.NO_SESSION, f"{type(msg).__name__} outside an authenticated session")
        if not P.check_seal(session.key, msg):
            raise self._unauthenticated(Refusal.BAD_MAC, f"{type(msg).__name__} with a bad session MAC")
        channel = msg.channel if isinstance(msg, P.Heartbeat) else 0
        if msg.seq <= session.seq.get(channel, 0):
            raise self._unauthenticated(Refusal.REPLAY, f"{type(msg).__name__} replayed (sequence {msg.seq})")
        session.seq[channel] = msg.seq
        return session.sender_id

    def end(self, sender: str) -> None:
        """Forget ``sender``'s session (Bye, or the sender is gone)."""
        session = self._session_of.pop(sender, None)
        if session is not None:
            self._sessions.pop(session, None)

    def _fail(self, cause: Refusal, detail: str) -> None:
        self.failures += 1
        self._refused(cause, detail)

    def _unauthenticated(self, cause: Refusal, detail: str) -> ProtocolError:
        self._fail(cause, detail)
        return ProtocolError(detail, ErrorCode.UNAUTHENTICATED)


def hello_refusal(gate: Gatekeeper, ident: bytes, hello: P.Hello, fingerprint: bytes, backend: str) -> str:
    """Why a receiver refuses ``hello`` ("" = it does not): authentication first, then
    compatibility (the KV fingerprint, the backend) and the socket identity."""
    refusal = gate.authenticate(ident, hello)
    if refusal is not None:
        return refusal
    if hello.fingerprint != fingerprint:
        return (f"incompatible KV fingerprint {hello.fingerprint.hex()[:16]} != "
                f"{fingerprint.hex()[:16]} (model, dtype, layout, block size or TP differ)")
    if hello.backend != backend:
        return f"backend mismatch: sender uses {hello.backend}, receiver {backend}"
    if ident != hello.sender_id.encode():
        return "socket identity does not match sender_id"
    return ""
