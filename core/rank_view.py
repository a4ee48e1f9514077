"""One worker's place in a tensor-parallel transfer: its rank, its KV heads, and the pieces it moves.

Built once per worker when vLLM registers the KV caches (:meth:`RankView.of`). The pure head
arithmetic is :mod:`kvrelay.core.ranks`; this module reads vLLM's config and the cache layout,
and refuses at start what cannot work (a TP size the config does not state, a head count that
does not divide, mixed TP over a layout whose heads it cannot find inside a block).

A head range of a block is a :class:`~kvrelay.kernels.blocks.Span`: one run of bytes in a
head-major block (vLLM's CPU layout, HND), a run per token in a token-major one (NHD, what
FlashAttention and FlashInfer use on GPUs). Either way a piece carries its heads' bytes in the
block's own order, so any prefill TP size can feed any decode TP size the heads divide.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvrelay.common.errors import ConfigError
from kvrelay.common.keys import Fingerprint
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.ranks import Heads, Piece, Sharding, part_transfer_id, piece_key, plan, receives, sends
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span


def tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank (0 outside a TP group)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, AttributeError):      # no TP group (unit tests, one rank)
        pc = getattr(vllm_config, "parallel_config", None)
        return int(getattr(pc, "rank", 0) or 0) % max(1, tp_size(vllm_config))


def tp_size(vllm_config: Any) -> int:
    """The engine's tensor-parallel size (1 when the config does not say)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)


def _kv_heads(vllm_config: Any, layout: KVLayout, tp: int) -> int:
    mc = vllm_config.model_config
    if getattr(mc, "use_mla", False) is True:
        return 1                           # one latent "head", held whole by every rank
    total = getattr(mc, "get_total_num_kv_heads", None)
    if callable(total):
        return int(total())
    return int(layout.block_shape()[0]) * tp     # a bare config (unit tests): vLLM's CPU layout


@dataclass(frozen=True)
class PieceTransfer:
    """One piece of a request on the wire: its sub-transfer, its key per chunk, and where its
    heads sit in a block of this rank (what the sending and the receiving rank both derive)."""

    piece: Piece
    transfer_id: str
    keys: list[bytes]
    span: Span


@dataclass(frozen=True)
class HeadGeometry:
    """How a block holds its heads: ``rows`` runs (the dimensions outside the heads), each of
    the rank's heads ``head_bytes`` wide in every run. ``head_bytes`` 0: not splittable."""

    rows: int
    head_bytes: int
    shape: str                  # the block's shape with the heads as "*" (what ranks must share)

    @classmethod
    def of(cls, layout: KVLayout, local_heads: int) -> HeadGeometry:
        shape, hd, runs = layout.block_shape(), layout.heads_dim, layout.head_runs()
        if hd is None or runs is None or shape[hd] != local_heads:
            return cls(1, 0, "")
        rows, inner = runs
        text = [str(n) for n in shape]
        text[hd] = "*"
        return cls(rows, inner, f"{layout.device.type}:[{', '.join(text)}]")


@dataclass(frozen=True)
class RankView:
    rank: int
    tp: int
    kv_heads: int
    heads: Heads                # the global KV heads this rank holds
    bytes_per_block: int        # one local block of one layer
    geometry: HeadGeometry      # where heads sit in a block (head_bytes 0: cannot be split)
    pieces: tuple[Piece, ...]   # the whole transfer plan between a prefill and a decode node

    @classmethod
    def of(cls, vllm_config: Any, layout: KVLayout, cfg: KVRelayConfig, role: str) -> RankView:
        """``role``: "prefill" or "decode" (whose configured TP this engine must match)."""
        tp = tp_size(vllm_config)
        key = f"engine.{role}_tp"
        configured = cfg.engine.prefill_tp if role == "prefill" else cfg.engine.decode_tp
        if tp != configured:
            raise ConfigError(f"this {role} engine runs tensor-parallel size {tp} but {key} is {configured}: set "
                              f"{key}: {tp} in every node's kvrelay config (the peers need it to split the KV)")
        kv_heads = _kv_heads(vllm_config, layout, tp)
        rank = tp_rank(vllm_config)
        heads = Sharding(kv_heads, tp).heads(rank)
        geometry = HeadGeometry.of(layout, len(heads)) if kv_heads > 1 else HeadGeometry(1, 0, "")
        pieces = tuple(plan(kv_heads, cfg.engine.prefill_tp, cfg.engine.decode_tp))
        view = cls(rank, tp, kv_heads, heads, layout.bytes_per_block, geometry, pieces)
        sender, receiver = Sharding(kv_heads, cfg.engine.prefill_tp), Sharding(kv_heads, cfg.engine.decode_tp)
        resharded = any(pc.heads != sender.heads(pc.src) or pc.heads != receiver.heads(pc.dst) for pc in pieces)
        if resharded and not geometry.head_bytes:      # refused on both sides, whichever would slice
            raise ConfigError(f"engine.prefill_tp {cfg.engine.prefill_tp} and engine.decode_tp "
                              f"{cfg.engine.decode_tp} differ, which re-shards KV heads inside each block; this "
                              f"engine's KV blocks are {list(layout.block_shape())} with no dimension of its "
                              f"{len(heads)} KV heads where vLLM's layout puts them: run prefill and decode at the "
                              "same TP size")
        return view

    def outgoing(self) -> list[Piece]:
        """Pieces this (prefill) rank sends."""
        return sends(list(self.pieces), self.rank)

    def incoming(self) -> list[Piece]:
        """Pieces this (decode) rank receives."""
        return receives(list(self.pieces), self.rank)

    def transfer(self, piece: Piece, transfer_id: str, chunk_keys: list[bytes]) -> PieceTransfer:
        """``piece`` of the request whose transfer is ``transfer_id`` and whose chunk keys (under the
        transfer fingerprint) are ``chunk_keys``."""
        return PieceTransfer(piece, part_transfer_id(transfer_id, piece, list(self.pieces)),
                             [piece_key(k, piece.heads, self.kv_heads) for k in chunk_keys], self.span(piece.heads))

    def span(self, heads: Heads) -> Span:
        """Where global heads ``heads`` sit inside one of this rank's blocks."""
        if heads == self.heads:
            return Span.whole(self.bytes_per_block)
        g = self.geometry
        if not g.head_bytes or heads.start < self.heads.start or heads.stop > self.heads.stop:
            raise ValueError(f"heads {heads} are not within this rank's {self.heads}")
        return Span(g.rows, self.bytes_per_block // g.rows, (heads.start - self.heads.start) * g.head_bytes,
                    len(heads) * g.head_bytes)

    def transfer_fingerprint(self, fp: Fingerprint, layout: KVLayout) -> Fingerprint:
        """What two ranks must share to exchange pieces: the engine fingerprint without the rank
        and, for blocks whose heads can be split, the block's shape around its heads (so TP sizes
        may differ, but not the layout: an NHD rank never feeds an HND one)."""
        g = self.geometry
        if not g.head_bytes:
            return dataclasses.replace(fp, tp_rank=0)
        isa = fp.kv_layout.partition("]")[2]                 # what follows the shape (a CPU's attention ISA)
        return dataclasses.replace(fp, tp_rank=0, tp_size=0, kv_layout=g.shape + isa,
                                   bytes_per_block=g.rows * g.head_bytes * self.kv_heads)
