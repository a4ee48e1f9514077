"""One worker's place in a tensor-parallel transfer: its rank, its KV heads, and the pieces it moves.

Built once per worker when vLLM registers the KV caches (:meth:`RankView.of`). The pure head
arithmetic is :mod:`kvrelay.core.ranks`; this module reads vLLM's config and the cache layout,
and refuses at start what cannot work (a TP size the config does not state, a head count that
does not divide, mixed TP over a layout whose blocks are not head-major).
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
    offset: int
    width: int


@dataclass(frozen=True)
class RankView:
    rank: int
    tp: int
    kv_heads: int
    heads: Heads                # the global KV heads this rank holds
    bytes_per_block: int        # one local block of one layer
    head_bytes: int             # one head's bytes in a block; 0 when blocks are not head-major
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
        head_major = layout.block_shape()[0] == len(heads) and kv_heads > 1
        pieces = tuple(plan(kv_heads, cfg.engine.prefill_tp, cfg.engine.decode_tp))
        view = cls(rank, tp, kv_heads, heads, layout.bytes_per_block,
                   layout.bytes_per_block // len(heads) if head_major else 0, pieces)
        sender, receiver = Sharding(kv_heads, cfg.engine.prefill_tp), Sharding(kv_heads, cfg.engine.decode_tp)
        resharded = any(pc.heads != sender.heads(pc.src) or pc.heads != receiver.heads(pc.dst) for pc in pieces)
        if resharded and not head_major:           # refused on both sides, whichever would slice
            raise ConfigError(f"engine.prefill_tp {cfg.engine.prefill_tp} and engine.decode_tp "
                              f"{cfg.engine.decode_tp} differ, which re-shards KV heads inside each block; this "
                              f"engine's KV blocks are {list(layout.block_shape())}, not head-major: run prefill "
                              "and decode at the same TP size")
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
        offset, width = self.byte_range(piece.heads)
        return PieceTransfer(piece, part_transfer_id(transfer_id, piece, list(self.pieces)),
                             [piece_key(k, piece.heads, self.kv_heads) for k in chunk_keys], offset, width)

    def byte_range(self, heads: Heads) -> tuple[int, int]:
        """``(offset, width)`` of global heads ``heads`` inside one of this rank's blocks."""
        if heads == self.heads:
            return 0, self.bytes_per_block
        if not self.head_bytes or heads.start < self.heads.start or heads.stop > self.heads.stop:
            raise ValueError(f"heads {heads} are not within this rank's {self.heads}")
        return (heads.start - self.heads.start) * self.head_bytes, len(heads) * self.head_bytes

    def transfer_fingerprint(self, fp: Fingerprint, layout: KVLayout) -> Fingerprint:
        """What two ranks must share to exchange pieces: the engine fingerprint without the rank
        and, for head-major blocks, with the layout of one head (so TP sizes may differ)."""
        if not self.head_bytes:
            return dataclasses.replace(fp, tp_rank=0)
        shape = list(layout.block_shape()[1:])
        return dataclasses.replace(fp, tp_rank=0, tp_size=0, kv_layout=f"{layout.device.type}:heads*{shape}",
                                   bytes_per_block=self.head_bytes * self.kv_heads)
