"""Gather (engine blocks -> chunk) and scatter (chunk -> engine blocks), all layers at once.

Every function takes a :class:`~kvrelay.kernels.layout.KVLayout` (the engine's cache as
planes of opaque blocks). Over the stacked ``[L, num_blocks, bytes_per_block]`` view a
gather or scatter over all layers is a single indexed copy; otherwise it loops per layer.

A chunk's payload is ``[plane][block]``: ``L x n`` blocks of ``bytes_per_block``
(``L`` = planes, called layers below). The pure-torch functions here are the
reference (and the CPU path); the CUDA versions in :mod:`kvrelay.kernels.cuda` are tested
against them, and :func:`gather` / :func:`scatter` fall back to the reference for
any layout the fast path does not take.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span


def _words(t: torch.Tensor, bpb: int) -> torch.Tensor:
    """View a ``[..., bpb]`` uint8 tensor as the widest integer words ``bpb`` allows.

    Indexed copies cost per element: on CPU a uint8 ``index_copy_`` of a 2 MiB chunk
    takes ~9 ms, the same copy in int64 words well under 1 ms.
    """
    for dt, size in ((torch.int64, 8), (torch.int32, 4)):
        if bpb % size == 0:
            try:
                return t.view(dt)
            except RuntimeError:          # misaligned storage offset: fall through to narrower words
                continue
    return t


def gather_ref(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into ``out``.

    block_ids: [n] int64 (engine block ids, on the cache's device)
    out:       [L, n, bytes_per_block] uint8, contiguous
    """
    if layout.stacked is not None:
        bpb = layout.bytes_per_block
        torch.index_select(_words(layout.stacked, bpb), 1, block_ids, out=_words(out, bpb))
        return out
    for i, t in enumerate(layout.layers):
        out[i].copy_(t.index_select(0, block_ids).reshape(len(block_ids), -1).view(torch.uint8))
    return out


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position in the chunk, first block id, length)`` of each run of consecutive ids."""
    runs, start = [], 0
    for k in range(1, len(block_ids) + 1):
        if k == len(block_ids) or block_ids[k] != block_ids[k - 1] + 1:
            runs.append((start, block_ids[start], k - start))
            start = k
    return runs


def scatter_ref(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` ([L, n, bytes_per_block] uint8) into blocks ``block_ids`` of every layer.

    On CPU, ``index_copy_`` copies index by index (~4 GB/s for a 2 MiB chunk here, 2.5x
    slower than a copy); a run of consecutive block ids (what a fresh request is mostly
    given) is one sliced copy over all layers instead."""
    if block_ids.device.type == "cpu":
        _scatter_runs(layout, block_ids, src)
        return
    if layout.stacked is not None:
        bpb = layout.bytes_per_block
        _words(layout.stacked, bpb).index_copy_(1, block_ids, _words(src, bpb))
        return
    shape = layout.block_shape()
    for i, t in enumerate(layout.layers):
        t.index_copy_(0, block_ids, src[i].view(t.dtype).reshape(len(block_ids), *shape))


def _scatter_runs(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    shape = layout.block_shape()
    for pos, first, n in _runs(block_ids.tolist()):
        if layout.stacked is not None:
            layout.stacked[:, first:first + n].copy_(src[:, pos:pos + n])    # [L, n, bpb] in one copy
            continue
        for i, t in enumerate(layout.layers):
            t[first:first + n].copy_(src[i, pos:pos + n].view(t.dtype).reshape(n, *shape))


def _fast_path(layout: KVLayout) -> bool:
    """The CUDA kernel takes device caches whose planes sit at one stride in one buffer."""
    if layout.device.type != "cuda" or layout.stacked is None:
        return False
    from kvrelay.kernels import cuda

    return cuda.available()


def gather(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dispatch: the CUDA kernel where the layout allows it, else the reference."""
    if _fast_path(layout):
        from kvrelay.kernels import cuda

        return cuda.gather(layout, block_ids, out)
    return gather_ref(layout, block_ids, out)


def gather_into_host(layout: KVLayout, block_ids: list[int], out: torch.Tensor, span: Span | None = None) -> torch.Tensor:
    """Range ``span`` (whole blocks when None) of blocks ``block_ids`` of every layer into ``out``,
    a host ``[L, n, span.nbytes]`` uint8 buffer the caller owns (and reuses: see
    :mod:`kvrelay.prefill.staging`); returns ``out``.

    A host cache gathers straight into ``out``; a device cache gathers on the device, then
    copies once into ``out``.
    """
    span = span or Span.whole(layout.bytes_per_block)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=layout.device)
    if layout.device.type == "cpu":
        return gather_range(layout, ids, out, span)
    dev = torch.empty(out.shape, dtype=torch.uint8, device=layout.device)
    out.copy_(gather_range(layout, ids, dev, span))
    return out


def _byte_planes(layout: KVLayout) -> list[torch.Tensor]:
    """Each plane as ``[num_blocks, bytes_per_block]`` uint8 views (a block is contiguous)."""
    return [t.view(torch.uint8).flatten(1) for t in layout.layers]


def gather_range(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor, span: Span) -> torch.Tensor:
    """Range ``span`` of blocks ``block_ids`` of every layer into ``out`` (a head range:
    :mod:`kvrelay.core.ranks`).

    block_ids: [n] int64;  out: [L, n, span.nbytes] uint8, contiguous
    """
    if span.is_whole:
        return gather(layout, block_ids, out)
    if _fast_path(layout):
        from kvrelay.kernels import cuda

        return cuda.gather(layout, block_ids, out, span)
    dst = out.view(out.shape[0], out.shape[1], span.rows, span.width)          # [L, n, rows, w]
    if layout.stacked is not None:
        torch.index_select(span.of(layout.stacked), 1, block_ids, out=dst)
        return out
    for i, plane in enumerate(_byte_planes(layout)):
        torch.index_select(span.of(plane), 0, block_ids, out=dst[i])
    return out


def scatter_range(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor, span: Span) -> None:
    """Write ``src`` ([L, n, span.nbytes] uint8) into range ``span`` of blocks ``block_ids`` of
    every layer; the rest of each block is left as it is."""
    if span.is_whole:
        scatter(layout, block_ids, src)
        return
    if _fast_path(layout):
        from kvrelay.kernels import cuda

        cuda.scatter(layout, block_ids, src, span)
        return
    rows = src.view(src.shape[0], src.shape[1], span.rows, span.width)          # [L, n, rows, w]
    stacked = span.of(layout.stacked) if layout.stacked is not None else None
    planes = [span.of(p) for p in _byte_planes(layout)] if stacked is None else []
    for pos, first, n in _runs(block_ids.cpu().tolist()):
        if stacked is not None:
            stacked[:, first:first + n].copy_(rows[:, pos:pos + n])              # [L, n, rows, w]
        for i, plane in enumerate(planes):
            plane[first:first + n].copy_(rows[i, pos:pos + n])


def scatter(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Dispatch: the CUDA kernel where the layout allows it, else the reference."""
    if _fast_path(layout):
        from kvrelay.kernels import cuda

        cuda.scatter(layout, block_ids, src)
        return
    scatter_ref(layout, block_ids, src)
