"""One exception hierarchy for the transport layer.

Backends translate their library's exceptions (``zmq.ZMQError``,
``nixl`` runtime errors, ``OSError``) at the boundary with
``raise TransportError(...) from exc`` so callers only ever catch these.

    KVRelayError
    ├── ConfigError              a config key or value is invalid (the message names the key)
    │   └── EngineIncompatible   an engine configuration kvrelay cannot serve exactly (names the flag)
    ├── ParamsError              malformed kv_transfer_params (kvrelay.core.params)
    ├── NoHealthyNode            the router has no healthy node in a pool (kvrelay.router.pools)
    └── TransportError
        ├── ProtocolError        malformed / oversize / wrong-version message (``.code``)
        ├── HandshakeError       Hello refused: fingerprint mismatch, bad HMAC
        ├── ChunkError           chunk failed validation (never installed)
        │   ├── ChecksumError    payload checksum mismatch
        │   └── MisroutedChunk   header names another transfer / key / index
        ├── PoolFullError        back-pressure deadline passed without free slots
        ├── TransferAborted      the transfer was aborted by either side
        ├── TransferTimeout      a deadline passed (lease, write, handshake)
        └── PeerDeadError        the peer stopped responding / disconnected
"""

from __future__ import annotations

import enum


class KVRelayError(Exception):
    """Base of every error kvrelay raises on purpose."""


class ConfigError(KVRelayError, ValueError):
    """A configuration value or key is invalid; the message names the key."""


class EngineIncompatible(ConfigError):
    """An engine configuration kvrelay cannot serve exactly; the message names the flag and the
    reason (:mod:`kvrelay.core.engine_compat`). Raised when a node starts, never at a request."""


class UnreachableError(KVRelayError):
    """A server a command must talk to (an engine, Prometheus) did not answer; the message names it."""


class TransportError(KVRelayError):
    """Something in the transport layer failed."""


class ErrorCode(str, enum.Enum):
    """Why a control frame was refused; travels in ``protocol.Error.code``."""

    MALFORMED = "malformed"
    OVERSIZE = "oversize"
    VERSION = "version"
    UNAUTHENTICATED = "unauthenticated"
    UNKNOWN_TRANSFER = "unknown_transfer"
    BAD_SLOT = "bad_slot"
    INVALID = "invalid"


class ProtocolError(TransportError):
    """A control or data frame is malformed, oversize or of an unsupported version.

    ``code`` says which, and is what the receiver answers in its ``Error`` reply."""

    def __init__(self, reason: str, code: ErrorCode = ErrorCode.INVALID) -> None:
        super().__init__(reason)
        self.code = code


class HandshakeError(TransportError):
    """The peer refused our Hello (or we refused its): the reason says why."""


class ChunkError(TransportError):
    """A received chunk is invalid (bad header, wrong key/transfer, truncated)."""


class ChecksumError(ChunkError):
    """A chunk's payload does not match its header checksum."""


class MisroutedChunk(ChunkError):
    """A chunk's header names another transfer, key or chunk index than the slot expects."""


class PoolFullError(TransportError):
    """No free receive slots before the back-pressure deadline."""


class TransferAborted(TransportError):
    """The transfer was aborted; its slots have been released."""


class TransferTimeout(TransportError):
    """A transport deadline expired."""


class PeerDeadError(TransportError):
    """The peer disconnected or stopped sending heartbeats."""
