"""Tensor-parallel ranks: which KV heads each rank holds, and which prefill rank feeds which decode rank.

vLLM splits a model's ``H`` KV heads evenly over ``T`` tensor-parallel ranks. With ``T <= H``
(``H % T == 0``) rank ``r`` holds heads ``[r*H/T, (r+1)*H/T)``; with ``T > H`` (``T % H == 0``)
each rank holds one head, rank ``r`` head ``r // (T/H)``, so every head is replicated ``T/H``
times. MLA models keep one latent "head" that every rank holds whole (``H = 1``).

A *piece* is what one prefill rank sends one decode rank for each chunk: a contiguous range of
global heads, for every layer and block of the chunk. For each head a decode rank needs, the
lowest prefill rank that holds it sends it, so a head replicated on several prefill ranks
travels once to each decode rank that installs it. With equal TP, rank ``r`` sends rank ``r``
its whole slice: one piece each, whole blocks, nothing re-sharded.

Each decode rank has its own transfer endpoint, the node's announced control port plus the
rank (:func:`rank_endpoint`), as vLLM's NIXL side channel does; a decode rank that receives
several pieces per chunk (from several prefill ranks) gets one sub-transfer per sender
(:func:`part_transfer_id`), and a chunk is installed on that rank when every piece is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvrelay.common.errors import ConfigError


@dataclass(frozen=True, order=True)
class Heads:
    """A range ``[start, stop)`` of global KV head indices."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, head: object) -> bool:
        return isinstance(head, int) and self.start <= head < self.stop


@dataclass(frozen=True)
class Sharding:
    """How ``kv_heads`` KV heads are spread over ``tp`` ranks (vLLM's rule)."""

    kv_heads: int
    tp: int

    def __post_init__(self) -> None:
        if self.kv_heads < 1 or self.tp < 1:
            raise ConfigError(f"KV heads ({self.kv_heads}) and TP size ({self.tp}) must be at least 1")
        if self.tp <= self.kv_heads and self.kv_heads % self.tp:
            raise ConfigError(f"TP {self.tp} does not divide the model's {self.kv_heads} KV heads")
        if self.tp > self.kv_heads and self.tp % self.kv_heads:
            raise ConfigError(f"TP {self.tp} is not a multiple of the model's {self.kv_heads} KV heads")

    def heads(self, rank: int) -> Heads:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside TP {self.tp}")
        if self.tp <= self.kv_heads:
            per = self.kv_heads // self.tp
            return Heads(rank * per, (rank + 1) * per)
        head = rank // (self.tp // self.kv_heads)
        return Heads(head, head + 1)

    def first_holder(self, head: int) -> int:
        """The lowest rank that holds ``head``."""
        return next(r for r in range(self.tp) if head in self.heads(r))


@dataclass(frozen=True)
class Piece:
    """Prefill rank ``src`` sends decode rank ``dst`` the heads ``heads`` of every chunk."""

    src: int
    dst: int
    heads: Heads


def plan(kv_heads: int, prefill_tp: int, decode_tp: int) -> list[Piece]:
    """Every piece of a chunk between a TP ``prefill_tp`` node and a TP ``decode_tp`` node,
    ordered by decode rank, then head."""
    p, d = Sharding(kv_heads, prefill_tp), Sharding(kv_heads, decode_tp)
    pieces: list[Piece] = []
    for dst in range(decode_tp):
        need = d.heads(dst)
        start = need.start
        for head in range(need.start, need.stop + 1):       # close a piece where the sender changes
            if head == need.stop or p.first_holder(head) != p.first_holder(start):
                pieces.append(Piece(p.first_holder(start), dst, Heads(start, head)))
                start = head
    return pieces


def sends(pieces: list[Piece], src: int) -> list[Piece]:
    """What prefill rank ``src`` sends (possibly nothing: its heads travel from a lower rank)."""
    return [pc for pc in pieces if pc.src == src]


def receives(pieces: list[Piece], dst: int) -> list[Piece]:
    """What decode rank ``dst`` receives, one piece per sending prefill rank."""
    return [pc for pc in pieces if pc.dst == dst]


def part_transfer_id(transfer_id: str, piece: Piece, pieces: list[Piece]) -> str:
    """The id of ``piece``'s sub-transfer on its decode rank: the transfer's own id when that
    rank has one sender (equal TP), else the id suffixed with the sender's rank."""
    if len(receives(pieces, piece.dst)) == 1:
        return transfer_id
    return f"{transfer_id}#p{piece.src}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Decode rank ``rank``'s control endpoint, from the node's (rank 0's) ``tcp://host:port``."""
    if rank == 0:
        return endpoint
    u = urlsplit(endpoint)
    if u.port is None:
        raise ConfigError(f"decode endpoint {endpoint!r} has no port")
    return f"{u.scheme}://{u.netloc.rsplit(':', 1)[0]}:{u.port + rank}"


def piece_key(chunk_key: bytes, heads: Heads, kv_heads: int) -> bytes:
    """A piece's content key: the chunk's key with the head range it carries (32 bytes)."""
    h = hashlib.sha256(b"kvrelay-piece\x1f")
    h.update(chunk_key)
    h.update(f"{heads.start}:{heads.stop}/{kv_heads}".encode())
    return h.digest()
