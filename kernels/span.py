"""``Span``: where a range of KV heads sits inside one block, as bytes.

What the prefill and decode ranks of a mixed-TP pair both derive (:mod:`kvrelay.core.rank_view`)
and what the gather and scatter kernels take (:mod:`kvrelay.kernels.blocks`, :mod:`kvrelay.kernels.cuda`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Span:
    """Where a range of KV heads sits in one block: the block read as ``rows`` rows of
    ``row_bytes`` and, of each row, ``width`` bytes from ``offset``.

    A head-major block (vLLM's CPU layout, HND: ``[heads, tokens, head]``) is one row, so a head
    range is one run of bytes; a token-major block (NHD: ``[tokens, heads, head]``) has a row per
    token, each holding every head. A piece's payload per block is its rows' ranges back to
    back: ``[rows][width]``, the same bytes in the same order on every rank whatever its TP size.
    """

    rows: int
    row_bytes: int
    offset: int
    width: int

    @classmethod
    def whole(cls, bytes_per_block: int) -> Span:
        return cls(1, bytes_per_block, 0, bytes_per_block)

    @property
    def nbytes(self) -> int:
        """Bytes of one block's range."""
        return self.rows * self.width

    @property
    def is_whole(self) -> bool:
        return self.offset == 0 and self.width == self.row_bytes

    def of(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., bytes_per_block]`` uint8 -> the range as a ``[..., rows, width]`` view."""
        return blocks.unflatten(-1, (self.rows, self.row_bytes))[..., self.offset:self.offset + self.width]
