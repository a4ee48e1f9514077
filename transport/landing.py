"""Where chunks land: the data plane's callbacks into the receiver's transfer table.

A backend reports each write through :class:`Landing` (its ``ReceiverHooks``), from any
thread and without blocking:

* :meth:`Landing.admit` - may this write touch its slot? Only the transfer's sender with
  its grant token, for a slot still waiting for that chunk (else a counted refusal);
* :meth:`Landing.deliver` - the chunk's bytes are complete: header, routing and checksum
  are verified, then a ``ChunkArrival`` is queued for the consumer, in completion order;
* :meth:`Landing.chunk_failed` / :meth:`reject` - the receive failed, or the chunk was
  bad: its slot is freed and the consumer sees ``ChunkRejected`` (and recomputes).

Invariant 6 of the design: the bytes installed are exactly the bytes verified, and only
the holder of a grant writes a slot.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from kvrelay.common.errors import ChecksumError, ChunkError, MisroutedChunk, TransportError
from kvrelay.common.secrets import same
from kvrelay.common.wire import HEADER_SIZE, verify_chunk
from kvrelay.transport.events import ChunkArrival, ChunkRejected, FailReason, Refusal
from kvrelay.transport.ledger import GrantedTransfer
from kvrelay.transport.pool import SlotRef
from kvrelay.transport.transfers import RefusedFn, TransferTable

log = logging.getLogger("kvrelay.transport.receiver")


class Landing:
    """The data-plane callbacks of one receiver. ``seen(sender)`` marks a sender alive;
    ``verify_payload`` False leaves a payload no backend hashed to the consumer, which hashes
    the exact bytes it installs (a late stale write cannot slip in between check and install)."""

    def __init__(self, table: TransferTable, refused: RefusedFn, seen: Callable[[str], None],
                 verify_payload: bool = True) -> None:
        self.table, self._refused, self._seen = table, refused, seen
        self.stats, self.pool = table.stats, table.pool
        self._verify_payload = verify_payload

    def admit(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes) -> Refusal | None:
        """None if the write comes from the transfer's sender with its grant token, for a slot
        still waiting for that chunk; else the refusal (counted)."""
        with self.table.lock:
            t = self.table.awaiting(tag, chunk_index, ref)
            cause = (Refusal.STALE if t is None else Refusal.FOREIGN if t.sender_id != sender
                     else None if same(token, t.token) else Refusal.BAD_TOKEN)
        if cause is Refusal.FOREIGN:
            self.stats.misrouted += 1
        if cause is not None:
            self._refused(cause, f"write of chunk {chunk_index} into slot {ref.index} from {sender!r}")
        return cause

    def deliver(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, token: bytes,
                payload_sum: int | None = None) -> None:
        """A backend says the bytes of ``chunk_index`` are complete in ``ref``."""
        if self.admit(sender, tag, chunk_index, ref, token) is not None:
            return
        with self.table.lock:
            t = self.table.awaiting(tag, chunk_index, ref)
            if t is None:                                 # resolved since admit looked
                return
            key = t.keys[chunk_index]
            self._seen(sender)
        device = self.pool.on_device               # its payload is the consumer's to verify
        try:
            if device:
                hdr = verify_chunk(self.pool.header_view(ref), tag=t.tag, key=key, chunk_index=chunk_index,
                                   check_payload=False, room=self.pool.slot_bytes - HEADER_SIZE)
            else:
                hdr = verify_chunk(self.pool.view(ref), tag=t.tag, key=key, chunk_index=chunk_index,
                                   payload_sum=payload_sum, check_payload=self._verify_payload)
        except ChunkError as exc:
            self.reject(t, chunk_index, exc)
            return
        t_arr = time.monotonic()
        with self.table.lock:
            if not self.table.current(t):                 # finished or failed while we verified
                self.stats.stale_writes += 1
                return
            try:
                self.pool.mark_filled(ref)
            except TransportError as exc:                 # reclaimed while we verified
                self.reject(t, chunk_index, exc)
                return
            t.resolved.add(chunk_index)
            t.landed.add(chunk_index)
            self.stats.chunks_arrived += 1
            self.stats.bytes_arrived += hdr.total_len
            verified = not device and (payload_sum is not None or self._verify_payload)
            self.table.publish(t.transfer_id, ChunkArrival(t.transfer_id, chunk_index, key, ref, hdr, t_arr, verified))
            self.table.maybe_done(t)

    def chunk_failed(self, sender: str, tag: bytes, chunk_index: int, ref: SlotRef, reason: str) -> None:
        """A backend's receive of ``chunk_index`` failed in the library: reject it now."""
        with self.table.lock:
            t = self.table.awaiting(tag, chunk_index, ref)
        if t is not None:
            self.reject(t, chunk_index, ChunkError(f"receive failed: {reason}"))

    def reject(self, t: GrantedTransfer, chunk_index: int, exc: TransportError) -> None:
        reason = FailReason.CHECKSUM if isinstance(exc, ChecksumError) else FailReason.INVALID_CHUNK
        if isinstance(exc, ChecksumError):
            self.stats.checksum_failures += 1
        elif isinstance(exc, MisroutedChunk):
            self.stats.misrouted += 1
        log.warning("rejected chunk %d of %r: %s", chunk_index, t.transfer_id, exc)
        with self.table.lock:
            if not self.table.current(t):
                self.stats.stale_writes += 1
                return
            self.stats.chunks_rejected += 1
            ref = t.slots.get(chunk_index)
            if ref is not None and chunk_index not in t.resolved:
                with contextlib.suppress(TransportError):
                    self.pool.release(ref)
            t.resolved.add(chunk_index)
            t.rejected += 1
            self.table.publish(t.transfer_id, ChunkRejected(t.transfer_id, chunk_index, reason, str(exc)))
            self.table.maybe_done(t)
