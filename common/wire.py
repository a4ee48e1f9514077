"""Chunk wire format: a versioned 128-byte header, then ``[layer][block]`` payload.

Header layout (little-endian, ``struct`` format ``HEADER_FMT``)::

    magic        4s   b"KVRC"
    version      H    WIRE_VERSION
    dtype        H    DType code (opaque to the transport, checked by the consumer)
    key          32s  chained chunk key (kvrelay.common.keys)
    transfer     16s  sha256(transfer_id)[:16]: detects misrouted chunks
    chunk_index  I
    num_layers   I
    num_blocks   I
    (pad)        I
    block_bytes  Q    bytes of one block of one layer
    payload_len  Q    == num_layers * num_blocks * block_bytes
    payload_sum  Q    xxh3_64 of the payload
    mac          16s  keyed BLAKE2b-128 of the fields above and the payload (:class:`DataMac`,
                      ``transport.data_mac``); zeros when off
    header_sum   Q    xxh3_64 of the header bytes before this field

The checksums catch accidents (a torn write, a bit flip, a misrouted chunk); anyone on the
wire could recompute them. The MAC, keyed from the deployment's shared secret, is what an
attacker who can rewrite data frames cannot forge (version 2; version 1 had no MAC field).

The payload is opaque block bytes: on CPU vLLM packs K transposed inside a
block, so blocks are copied whole and never sliced per token. A chunk whose
header or payload fails validation is never installed; the consumer recomputes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvrelay.common.errors import ChecksumError, ChunkError, MisroutedChunk
from kvrelay.common.keys import KEY_BYTES

MAGIC = b"KVRC"
WIRE_VERSION = 2
HEADER_FMT = "<4sHH32s16sIIIIQQQ16sQ"
MAC_BYTES = 16
NO_MAC = bytes(MAC_BYTES)
_PREFIX = struct.Struct(HEADER_FMT[:-1])        # everything but header_sum
HEADER_STRUCT = struct.Struct(HEADER_FMT)
HEADER_SIZE = 128                                # payload starts 128-byte aligned
assert HEADER_STRUCT.size <= HEADER_SIZE

Buffer = bytes | bytearray | memoryview


class DType(enum.IntEnum):
    OPAQUE = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FP8_E4M3 = 4
    UINT8 = 5


def transfer_tag(transfer_id: str) -> bytes:
    """The 16-byte wire tag of a transfer id."""
    return hashlib.sha256(transfer_id.encode()).digest()[:16]


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: bytes
    transfer: bytes
    chunk_index: int
    num_layers: int
    num_blocks: int
    block_bytes: int
    payload_sum: int
    dtype: DType = DType.OPAQUE
    version: int = WIRE_VERSION
    mac: bytes = NO_MAC

    @property
    def payload_len(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @property
    def total_len(self) -> int:
        return HEADER_SIZE + self.payload_len

    def pack(self) -> bytes:
        prefix = self._prefix(self.mac)
        out = prefix + struct.pack("<Q", xxhash.xxh3_64_intdigest(prefix))
        return out.ljust(HEADER_SIZE, b"\x00")

    def signed_fields(self) -> bytes:
        """What :class:`DataMac` signs besides the payload: every field but the MAC itself."""
        return self._prefix(NO_MAC)

    def _prefix(self, mac: bytes) -> bytes:
        return _PREFIX.pack(MAGIC, self.version, int(self.dtype), self.key, self.transfer,
                            self.chunk_index, self.num_layers, self.num_blocks, 0,
                            self.block_bytes, self.payload_len, self.payload_sum, mac)


@dataclass(frozen=True)
class DataMac:
    """A keyed MAC on data frames (``transport.data_mac``): BLAKE2b-128 keyed with a key derived
    from the shared secret, over a header's fields and its payload.

    Contract: :meth:`sign` on the sender, over the payload's ``[layer][block]`` regions in wire
    order; :meth:`check` on the receiver, over the bytes it installs, raising
    :class:`ChecksumError` (the chunk is recomputed, as for any corrupt chunk). It costs one
    more pass over the payload on each side (BLAKE2b: about 1 GB/s per core), which is why it is
    opt-in: without it the checksums catch accidents, not an attacker on the wire.
    """

    key: bytes

    def tag(self, hdr: ChunkHeader, regions: Sequence[Buffer]) -> bytes:
        h = hashlib.blake2b(key=self.key, digest_size=MAC_BYTES)
        h.update(hdr.signed_fields())
        for r in regions:
            h.update(r)
        return h.digest()

    def sign(self, hdr: ChunkHeader, regions: Sequence[Buffer]) -> ChunkHeader:
        return dataclasses.replace(hdr, mac=self.tag(hdr, regions))

    def check(self, hdr: ChunkHeader, regions: Sequence[Buffer]) -> None:
        if not hmac.compare_digest(self.tag(hdr, regions), hdr.mac):
            raise ChecksumError(f"data MAC mismatch in chunk {hdr.chunk_index} (key {hdr.key.hex()[:16]}): "
                                "forged, or signed with another secret")


def payload_checksum(regions: Sequence[Buffer]) -> int:
    """xxh3_64 over the concatenation of ``regions`` without concatenating them."""
    h = xxhash.xxh3_64()
    for r in regions:
        h.update(r)
    return h.intdigest()


def make_header(key: bytes, transfer_id: str, chunk_index: int, regions: Sequence[Buffer], *,
                num_layers: int = 1, num_blocks: int = 1, dtype: DType = DType.OPAQUE,
                payload_sum: int | None = None, mac: DataMac | None = None) -> ChunkHeader:
    """Build the header for a payload given as ``regions`` (in ``[layer][block]`` order).
    ``payload_sum``: the payload's checksum when the caller already has it (the same bytes were
    hashed for a store record), so a chunk that is stored and pushed is hashed once. ``mac``:
    sign it (``transport.data_mac``; None: no MAC)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    total = sum(memoryview(r).nbytes for r in regions)
    units = num_layers * num_blocks
    if units <= 0 or total % units:
        raise ValueError(f"payload of {total} bytes is not {num_layers} layers x {num_blocks} blocks")
    hdr = ChunkHeader(key=key, transfer=transfer_tag(transfer_id), chunk_index=chunk_index,
                      num_layers=num_layers, num_blocks=num_blocks, block_bytes=total // units,
                      payload_sum=payload_checksum(regions) if payload_sum is None else payload_sum,
                      dtype=dtype)
    return hdr if mac is None else mac.sign(hdr, regions)


def parse_header(buf: Buffer) -> ChunkHeader:
    """Decode and validate a header (magic, version, header checksum). Raises ChunkError."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_SIZE:
        raise ChunkError(f"truncated header: {mv.nbytes} < {HEADER_SIZE} bytes")
    raw = bytes(mv[:HEADER_STRUCT.size])
    (magic, version, dtype, key, transfer, idx, layers, blocks, _pad, block_bytes, plen, psum, mac,
     hsum) = HEADER_STRUCT.unpack(raw)
    if magic != MAGIC:
        raise ChunkError(f"bad magic {magic!r}; not a kvrelay chunk")
    if version != WIRE_VERSION:
        raise ChunkError(f"unsupported chunk wire version {version} (this node speaks {WIRE_VERSION})")
    if xxhash.xxh3_64_intdigest(raw[:_PREFIX.size]) != hsum:
        raise ChunkError("header checksum mismatch")
    if plen != layers * blocks * block_bytes:
        raise ChunkError(f"payload_len {plen} != {layers}x{blocks}x{block_bytes}")
    try:
        dt = DType(dtype)
    except ValueError as exc:
        raise ChunkError(f"unknown dtype code {dtype}") from exc
    return ChunkHeader(key=key, transfer=transfer, chunk_index=idx, num_layers=layers,
                       num_blocks=blocks, block_bytes=block_bytes, payload_sum=psum, dtype=dt,
                       version=version, mac=mac)


def verify_chunk(buf: Buffer, *, transfer_id: str | None = None, key: bytes | None = None,
                 chunk_index: int | None = None, payload_sum: int | None = None,
                 tag: bytes | None = None, check_payload: bool = True, room: int | None = None) -> ChunkHeader:
    """Validate a whole received chunk (header + payload) in place.

    Checks the header, that the payload fits, the payload checksum, and - when
    given - that the chunk belongs to ``transfer_id`` (or its precomputed ``tag``) / ``key`` / ``chunk_index``
    (a misrouted chunk). ``payload_sum``, when given, is the xxh3_64 a backend already
    computed over these payload bytes as they landed; it replaces re-hashing them.
    ``check_payload=False`` (and no ``payload_sum``) leaves the payload to the consumer,
    which hashes the exact bytes it installs (:func:`check_payload`). ``room``: the payload
    bytes the slot holds, where ``buf`` is the header alone (a pool in device memory keeps its
    headers on the host; its payload is left to the consumer).
    Raises :class:`ChunkError` or :class:`ChecksumError`.
    """
    mv = memoryview(buf)
    hdr = parse_header(mv)
    available = mv.nbytes - HEADER_SIZE if room is None else room
    if hdr.payload_len > available:
        raise ChunkError(f"truncated chunk: header says {hdr.payload_len} payload bytes, {available} available")
    if tag is None and transfer_id is not None:
        tag = transfer_tag(transfer_id)
    if tag is not None and hdr.transfer != tag:
        raise MisroutedChunk(f"misrouted chunk: transfer tag {hdr.transfer.hex()} != expected {tag.hex()}")
    if key is not None and hdr.key != key:
        raise MisroutedChunk(f"misrouted chunk: key {hdr.key.hex()[:16]} != expected {key.hex()[:16]}")
    if chunk_index is not None and hdr.chunk_index != chunk_index:
        raise MisroutedChunk(f"misrouted chunk: index {hdr.chunk_index} != expected {chunk_index}")
    if payload_sum is None and not check_payload:
        return hdr
    if payload_sum is None:
        payload_sum = xxhash.xxh3_64_intdigest(mv[HEADER_SIZE:HEADER_SIZE + hdr.payload_len])
    if payload_sum != hdr.payload_sum:
        raise _mismatch(hdr)
    return hdr


def check_payload(hdr: ChunkHeader, payload: Buffer) -> None:
    """Raise :class:`ChecksumError` unless ``payload`` is the bytes ``hdr`` was made for."""
    check_regions(hdr, (payload,))


def check_regions(hdr: ChunkHeader, regions: Sequence[Buffer]) -> None:
    """Raise :class:`ChecksumError` unless the concatenation of ``regions`` (read in place,
    never joined) is the payload ``hdr`` was made for."""
    if payload_checksum(regions) != hdr.payload_sum:
        raise _mismatch(hdr)


def _mismatch(hdr: ChunkHeader) -> ChecksumError:
    return ChecksumError(f"payload checksum mismatch in chunk {hdr.chunk_index} (key {hdr.key.hex()[:16]})")


COPY_PIECE = 256 << 10      # fits in L2 beside its source; larger pieces fall out of it before the hash
FUSE_FROM = 2 << 20         # below this a copy then a hash stays in L2 anyway (fused costs a little more)


def copy_checked(hdr: ChunkHeader, src: Buffer, dst: Buffer) -> None:
    """Copy the payload ``src`` into ``dst`` (same size, flat bytes) and verify it in that pass.

    Large payloads are copied in :data:`COPY_PIECE` pieces, each hashed right after it is
    written, while it is still in cache: one trip through memory instead of two (``kvrelay
    bench transfer`` measures it against a copy then a hash in the same run). The hash is taken over the
    bytes written to ``dst``, so what is verified is what the caller keeps. Raises
    :class:`ChecksumError` after the copy when they are not the bytes ``hdr`` was made for.
    """
    s, d = memoryview(src).cast("B"), memoryview(dst).cast("B")
    if s.nbytes != d.nbytes:
        raise ValueError(f"copy_checked: {s.nbytes}-byte source into a {d.nbytes}-byte destination")
    piece = COPY_PIECE if s.nbytes >= FUSE_FROM else max(s.nbytes, 1)
    h = xxhash.xxh3_64()
    for off in range(0, s.nbytes, piece):
        d[off:off + piece] = s[off:off + piece]
        h.update(d[off:off + piece])
    if h.intdigest() != hdr.payload_sum:
        raise _mismatch(hdr)
