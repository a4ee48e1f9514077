"""Store events: which chunks entered or left a prefill node's store, for cache-aware routing.

The schema (:class:`StoreEvent`) and its ZeroMQ PUB (:class:`Publisher`) live with
the store, so the router can subscribe without importing the engine side (no torch).

Events carry no chunk key as the store knows it: each is salted with a key derived from
the deployment secret (:func:`published_key`), so someone who can subscribe but has no
secret cannot test whether a prompt they guess is cached. The router, which holds the
secret, salts the keys it computes alike. The publisher binds ``store.publish_host``
(default: ``transport.host``) and is otherwise unauthenticated: it belongs on the private
network with the transfer ports.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import threading

import msgspec
import zmq

from kvrelay.common.listen import ListeningSocket

STORE_EVENT_VERSION = 2        # 2: keys salted (published_key)


def published_key(salt: bytes, key: bytes) -> bytes:
    """What an event says for chunk ``key``: a keyed BLAKE2b of it (``salt``: the secret's
    ``KeyUse.EVENTS`` key), so the published name reveals nothing without the secret."""
    return hashlib.blake2b(key, key=salt[:64], digest_size=32).digest()


class StoreEventKind(str, enum.Enum):
    STORED = "stored"
    EVICTED = "evicted"


class StoreEvent(msgspec.Struct, frozen=True):
    """Published by a prefill node: chunks that entered (``stored``) or left (``evicted``) its store.

    ``fingerprint`` is the node's engine fingerprint digest - the router needs it to
    compute the same chunk keys from a request's tokens."""

    kind: StoreEventKind
    keys: list[bytes]
    fingerprint: bytes
    chunk_tokens: int
    v: int = STORE_EVENT_VERSION


def decode_event(raw: bytes) -> StoreEvent:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` on anything else."""
    return msgspec.msgpack.decode(raw, type=StoreEvent)


class Publisher:
    """ZeroMQ PUB of StoreEvents (thread-safe; the store calls it from several threads).

    Events are hints: a slow subscriber loses them (non-blocking send), never stalls the store.
    Nothing is published until :meth:`bind_engine` names the fingerprint and chunk size."""

    def __init__(self, host: str, port: int, salt: bytes) -> None:
        self.salt = salt
        self._listening = ListeningSocket(zmq.PUB, "the store event publisher", host, port, {zmq.SNDHWM: 10000})
        self._sock = self._listening.sock
        self._lock = threading.Lock()
        self.fingerprint = b""
        self.chunk_tokens = 0

    def bind_engine(self, fingerprint: bytes, chunk_tokens: int) -> None:
        self.fingerprint, self.chunk_tokens = fingerprint, chunk_tokens

    def __call__(self, kind: str, keys: list[bytes]) -> None:
        if not self.fingerprint:
            return
        event = StoreEvent(StoreEventKind(kind), [published_key(self.salt, k) for k in keys], self.fingerprint,
                           self.chunk_tokens)
        msg = msgspec.msgpack.encode(event)
        with self._lock, contextlib.suppress(zmq.Again):
            self._sock.send(msg, zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._listening.close()
