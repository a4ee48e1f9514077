"""What a consumer of the receive side sees, per transfer, in completion order."""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from kvrelay.common.wire import ChunkHeader
from kvrelay.transport.pool import SlotRef


class FailReason(enum.Enum):
    CHECKSUM = "checksum"            # payload checksum mismatch
    INVALID_CHUNK = "invalid_chunk"  # bad header, truncated, misrouted
    LEASE_EXPIRED = "lease_expired"  # slot not filled / not consumed in time
    ABORTED = "aborted"              # sender (or consumer) aborted
    PEER_DEAD = "peer_dead"          # sender disconnected / stopped heart-beating
    POOL_FULL = "pool_full"          # Alloc refused after back-pressure


class Refusal(str, enum.Enum):
    """Why the receiver refused something that claimed to come from a sender (counted by cause)."""

    BAD_MAC = "bad_mac"                  # a Hello or sealed message whose MAC does not verify
    REPLAY = "replay"                    # a used or unknown challenge; a sequence number not above the last
    NO_SESSION = "no_session"            # a message before a successful Hello, or for an unknown session
    FOREIGN = "foreign"                  # an Abort or write for a transfer its sender does not own
    BAD_TOKEN = "bad_token"              # a write that does not present its transfer's grant token
    UNAUTHENTICATED_DATA = "unauthenticated_data"   # a data connection without a valid session token
    STALE = "stale"                      # a write for a slot no longer leased to that chunk (not an attack)
    BAD_ALLOC = "bad_alloc"              # an authenticated Alloc this transfer cannot have (answered Refused)


@dataclass(frozen=True, slots=True)
class ChunkArrival:
    """Chunk bytes are in ``slot`` and verified. The consumer holds the slot until ``release``."""

    transfer_id: str
    chunk_index: int
    key: bytes
    slot: SlotRef
    header: ChunkHeader
    t_arrival: float          # time.monotonic() when the bytes were known complete
    verified: bool = True     # payload checksum checked on arrival; False: the consumer must
                              # (``wire.check_payload`` on the bytes it installs)


@dataclass(frozen=True)
class ChunkRejected:
    """One chunk failed; it was never installed and its slot is already free."""

    transfer_id: str
    chunk_index: int
    reason: FailReason
    detail: str


@dataclass(frozen=True)
class TransferFailed:
    """The whole transfer ended abnormally; no further events follow."""

    transfer_id: str
    reason: FailReason
    detail: str


@dataclass(frozen=True)
class TransferDone:
    """Every granted chunk either arrived or was rejected; no further events follow."""

    transfer_id: str
    arrived: int
    rejected: int
    held: tuple[int, ...]     # chunk indices the receiver already had (never sent)


Event = ChunkArrival | ChunkRejected | TransferFailed | TransferDone


@dataclass
class ReceiverStats:
    messages: int = 0
    malformed: int = 0
    unauthenticated: int = 0
    chunks_arrived: int = 0
    bytes_arrived: int = 0
    chunks_rejected: int = 0
    checksum_failures: int = 0
    misrouted: int = 0
    stale_writes: int = 0
    aborts: int = 0
    peers_dead: int = 0
    alloc_refused: int = 0
    alloc_parked: int = 0
    internal_errors: int = 0         # bugs caught by the control loop (it keeps serving)
    orphans_dropped: int = 0         # transfers no consumer registered, dropped after lease_s
    takeovers: int = 0               # transfers a second sender took over (the router's prefill retry)
    foreign_aborts: int = 0          # Aborts for a transfer the sender does not own (ignored)
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)   # by Refusal value
