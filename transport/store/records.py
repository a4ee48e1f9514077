"""The store's record format: made, checked and read here and nowhere else.

A record is the wire header (:mod:`transport.wire`: key, xxh3 payload checksum,
header checksum) followed by the ``[layer][block]`` payload - the same bytes that
travel between nodes. Every tier checks a record when it reads it back; one that
fails (a flipped bit on disk, a truncated Redis value, a record under the wrong key)
is a miss, never returned.
"""

from __future__ import annotations

from transport.errors import ChunkError, ProtocolError
from transport.wire import HEADER_SIZE, Buffer, ChunkHeader, make_header, parse_header, verify_chunk

RECORD_TAG = "store"    # the transfer id records are stamped with (they belong to no transfer)


def make_record(key: bytes, chunk_index: int, payload: Buffer, *, num_layers: int, num_blocks: int) -> bytes:
    """One stored chunk: header + ``payload`` (``[num_layers][num_blocks]`` whole blocks)."""
    return make_header(key, RECORD_TAG, chunk_index, [payload], num_layers=num_layers,
                       num_blocks=num_blocks).pack() + bytes(payload)


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
