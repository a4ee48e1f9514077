"""Triton gather/scatter for KV caches in GPU memory (one launch over all layers).

One kernel for both directions (``GATHER`` is a compile-time flag), for whole blocks and
for a head range of each (a :class:`~kvrelay.kernels.blocks.Span`: ``rows`` runs of ``width``
bytes, one run in a head-major block, one per token in a token-major one).
Grid: ``(L * n, ceil(span_words / BLOCK))``; program ``(p, q)`` copies words
``[q*BLOCK, (q+1)*BLOCK)`` of the span of block ``block_ids[p % n]`` of layer ``p // n``.
Blocks are moved as 16-byte words when ``bytes_per_block`` allows (else 4-byte),
so the copy is bandwidth-bound. The pure-torch versions in :mod:`kvrelay.kernels.blocks`
are the reference; ``tests/gpu/check.sh`` checks and times these on a GPU.
Importing this module without Triton or CUDA is safe; :func:`available` says so.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(cache_ptr, chunk_ptr, ids_ptr, n, layer_stride, block_words, row_words, off_words,  # type: ignore[no-untyped-def]
              width_words, span_words, GATHER: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0)                      # (layer, block) pair: layer = p // n
        q = tl.program_id(1)                      # which BLOCK-word slice of the block's span
        blk = tl.load(ids_ptr + p % n).to(tl.int64)
        offs = q * BLOCK + tl.arange(0, BLOCK)    # word of the span: row offs // width, column offs % width
        mask = offs < span_words
        row, col = offs // width_words, offs % width_words
        cache = cache_ptr + (p // n).to(tl.int64) * layer_stride + blk * block_words + row * row_words + off_words + col
        chunk = chunk_ptr + p.to(tl.int64) * span_words + offs
        if GATHER:
            tl.store(chunk, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(chunk, mask=mask), mask=mask)

    return _copy


def _word_dtype(*sizes: int) -> tuple[torch.dtype, int]:
    # Triton has no 128-bit integer; int64 pairs are the widest portable word.
    for dt, size in ((torch.int64, 8), (torch.int32, 4)):
        if all(s % size == 0 for s in sizes):
            return dt, size
    return torch.uint8, 1


def _launch(layout: KVLayout, block_ids: torch.Tensor, chunk: torch.Tensor, gather: bool, span: Span | None) -> None:
    if layout.stacked is None:
        raise ValueError("CUDA gather/scatter needs layers at a constant stride in one buffer")
    bpb = layout.bytes_per_block
    span = span or Span.whole(bpb)
    st = layout.stacked                              # [L, num_blocks, bpb] uint8
    dt, size = _word_dtype(bpb, span.row_bytes, span.offset, span.width)
    cache = st.view(dt)                              # [L, num_blocks, bpb / size]
    flat = chunk.view(dt)                            # [L, n, span.nbytes / size]
    n, span_words = block_ids.numel(), span.nbytes // size
    BLOCK = 1024
    grid = (layout.num_layers * n, (span_words + BLOCK - 1) // BLOCK)
    ids = block_ids.to(device=st.device, dtype=torch.int64)
    _kernel()[grid](cache, flat, ids, n, cache.stride(0), bpb // size, span.row_bytes // size, span.offset // size,
                    span.width // size, span_words, GATHER=gather, BLOCK=BLOCK)


def gather(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor, span: Span | None = None) -> torch.Tensor:
    """out[L, n, span.nbytes] (uint8, CUDA, contiguous) <- range ``span`` (whole blocks when None)
    of cache blocks ``block_ids`` of every layer."""
    _launch(layout, block_ids, out, True, span)
    return out


def scatter(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor, span: Span | None = None) -> None:
    """range ``span`` (whole blocks when None) of cache blocks ``block_ids`` of every layer <-
    src[L, n, span.nbytes] (uint8, CUDA, contiguous)."""
    _launch(layout, block_ids, src, False, span)
