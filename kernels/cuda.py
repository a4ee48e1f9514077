"""Triton gather/scatter for KV caches in GPU memory (one launch over all layers).

One kernel for both directions (``GATHER`` is a compile-time flag).
Grid: ``(L * n, ceil(words_per_block / BLOCK))``; program ``(p, q)`` copies words
``[q*BLOCK, (q+1)*BLOCK)`` of block ``block_ids[p % n]`` of layer ``p // n``.
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
    def _copy(cache_ptr, chunk_ptr, ids_ptr, n, layer_stride, words, GATHER: tl.constexpr,  # type: ignore[no-untyped-def]
              BLOCK: tl.constexpr):
        p = tl.program_id(0)                      # (layer, block) pair: layer = p // n
        q = tl.program_id(1)                      # which BLOCK-word slice of the block
        blk = tl.load(ids_ptr + p % n).to(tl.int64)
        offs = q * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words
        cache = cache_ptr + (p // n).to(tl.int64) * layer_stride + blk * words + offs
        chunk = chunk_ptr + p.to(tl.int64) * words + offs
        if GATHER:
            tl.store(chunk, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(chunk, mask=mask), mask=mask)

    return _copy


def _word_dtype(bpb: int) -> tuple[torch.dtype, int]:
    # Triton has no 128-bit integer; int64 pairs are the widest portable word.
    for dt, size in ((torch.int64, 8), (torch.int32, 4)):
        if bpb % size == 0:
            return dt, size
    return torch.uint8, 1


def _launch(layout: KVLayout, block_ids: torch.Tensor, chunk: torch.Tensor, gather: bool) -> None:
    if layout.stacked is None:
        raise ValueError("CUDA gather/scatter needs layers at a constant stride in one buffer")
    st = layout.stacked                              # [L, num_blocks, bpb] uint8
    dt, size = _word_dtype(layout.bytes_per_block)
    words = layout.bytes_per_block // size
    cache = st.view(dt)                              # [L, num_blocks, words]
    flat = chunk.view(dt)
    n = block_ids.numel()
    BLOCK = 1024
    grid = (layout.num_layers * n, (words + BLOCK - 1) // BLOCK)
    ids = block_ids.to(device=st.device, dtype=torch.int64)
    _kernel()[grid](cache, flat, ids, n, cache.stride(0), words, GATHER=gather, BLOCK=BLOCK)


def gather(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[L, n, bpb] (uint8, CUDA, contiguous) <- cache blocks ``block_ids`` of every layer."""
    _launch(layout, block_ids, out, gather=True)
    return out


def scatter(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """cache blocks ``block_ids`` of every layer <- src[L, n, bpb] (uint8, CUDA, contiguous)."""
    _launch(layout, block_ids, src, gather=False)
