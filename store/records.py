"""The store's record format: made, checked and read here and nowhere else.

A record is the wire header (:mod:`kvrelay.common.wire`: key, xxh3 payload checksum,
header checksum) followed by the ``[layer][block]`` payload - the same bytes that
travel between nodes. Every tier checks a record when it reads it back; one that
fails (a flipped bit on disk, a truncated Redis value, a record under the wrong key)
is a miss, never returned.

Records in the *shared* tiers (disk, Redis) are also sealed (:class:`RecordSeal`): a
keyed BLAKE2b-256 over the chunk key and the record, under the deployment's store key.
Anyone who can write to Redis or the disk directory but does not hold the secret
cannot make a record a node will load: it is a miss, counted as forged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from kvrelay.common.errors import ChunkError, ProtocolError
from kvrelay.common.secrets import KeyUse, derive_key
from kvrelay.common.wire import HEADER_SIZE, Buffer, ChunkHeader, make_header, parse_header, verify_chunk

RECORD_TAG = "store"    # the transfer id records are stamped with (they belong to no transfer)


def seal_for(secret: bytes) -> RecordSeal:
    """The deployment's record seal (the store key derived from the shared secret)."""
    return RecordSeal(derive_key(secret, KeyUse.STORE))


class RecordSeal:
    """Appends and checks the keyed MAC of records in the shared tiers."""

    SIZE = 32

    def __init__(self, store_key: bytes) -> None:
        self._key = store_key[:64]          # BLAKE2b takes keys of up to 64 bytes

    def _tag(self, key: bytes, record: Buffer) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=self.SIZE, person=b"kvrelay-record")
        h.update(key)
        h.update(record)
        return h.digest()

    def seal(self, key: bytes, record: Buffer) -> bytes:
        """``record`` followed by its MAC (what a shared tier stores)."""
        return bytes(record) + self._tag(key, record)

    def open(self, key: bytes, sealed: bytes | memoryview) -> memoryview | None:
        """The record inside ``sealed`` if its MAC verifies for ``key``, else None."""
        view = memoryview(sealed)
        if view.nbytes <= self.SIZE:
            return None
        record, tag = view[:-self.SIZE], view[-self.SIZE:]
        return record if hmac.compare_digest(self._tag(key, record), bytes(tag)) else None


def build_record(key: bytes, chunk_index: int, payload_len: int, fill: Callable[[memoryview], None], *,
                 num_layers: int, num_blocks: int) -> bytearray:
    """One stored chunk made in place: ``fill`` writes the ``payload_len``-byte payload straight
    into the record, then the header (with the payload's checksum) goes in front. One buffer and
    one copy (the fill's), where gathering into a buffer of its own and prepending a header take
    three of each. The record is handed over: the store keeps it as is, so the caller must not
    change it afterwards (reading it, e.g. to push the same chunk, is fine)."""
    record = bytearray(HEADER_SIZE + payload_len)
    payload = memoryview(record)[HEADER_SIZE:]
    fill(payload)
    record[:HEADER_SIZE] = make_header(key, RECORD_TAG, chunk_index, [payload], num_layers=num_layers,
                                       num_blocks=num_blocks).pack()
    payload.release()
    return record


def check_record(key: bytes, record: bytes | memoryview) -> bool:
    """True if ``record`` is an intact chunk stored under ``key``."""
    try:
        verify_chunk(record, key=key)
    except (ChunkError, ProtocolError):
        return False
    return True


def read_record(record: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """``(header, payload)`` of a checked record. Raises :class:`ChunkError` if it is not one."""
    view = memoryview(record)
    hdr = parse_header(view)
    if len(view) < HEADER_SIZE + hdr.payload_len:
        raise ChunkError(f"record truncated: {len(view)} bytes < {HEADER_SIZE + hdr.payload_len}")
    return hdr, view[HEADER_SIZE:HEADER_SIZE + hdr.payload_len]
