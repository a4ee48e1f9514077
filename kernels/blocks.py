"""Gather (engine blocks -> chunk) and scatter (chunk -> engine blocks), all layers at once.

vLLM hands a connector one KV tensor per attention layer. :class:`KVLayout` turns
them into *planes*, each ``[num_blocks, ...]`` with a contiguous block, and copies
whole blocks of every plane as opaque bytes (never per token: on CPU K sits
transposed inside a block). The shapes vLLM's backends use:

* CPU attention: ``[num_blocks, kv_heads, block_size, 2*head_size]`` - one plane;
* FlashInfer, MLA: ``[num_blocks, 2, block_size, heads, head]`` / ``[num_blocks,
  block_size, dim]`` - one plane (the block is the leading dimension);
* FlashAttention: ``[2, num_blocks, block_size, kv_heads, head]`` (K and V apart) -
  two planes, ``[0]`` (K) and ``[1]`` (V), named ``<layer>.k`` / ``<layer>.v``.

:class:`KVLayout` views those tensors as bytes. When every layer is a view into
one buffer at a constant stride (what vLLM allocates), it builds one strided
``[L, num_blocks, bytes_per_block]`` uint8 view so a gather or scatter over all
layers is a single indexed copy; otherwise it falls back to a per-layer loop.

A chunk's payload is ``[plane][block]``: ``L x n`` blocks of ``bytes_per_block``
(``L`` = planes, called layers below). The pure-torch functions here are the
reference (and the CPU path); the CUDA versions in :mod:`kernels.cuda` are tested
against them, and :func:`gather` / :func:`scatter` fall back to the reference for
any layout the fast path does not take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from transport.store.records import build_record
from transport.wire import HEADER_SIZE


@dataclass
class KVLayout:
    names: list[str]                 # layer names, in engine order
    layers: list[torch.Tensor]       # [num_blocks, ...] per layer, engine dtype
    num_blocks: int
    bytes_per_block: int
    dtype: torch.dtype
    stacked: torch.Tensor | None     # [L, num_blocks, bytes_per_block] uint8 view, if expressible

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def chunk_bytes(self, n_blocks: int) -> int:
        return self.num_layers * n_blocks * self.bytes_per_block

    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape[1:])

    @classmethod
    def from_caches(cls, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        names, layers = _planes(kv_caches)
        if not layers:
            raise ValueError("no KV cache tensors registered")
        first = layers[0]
        for n, t in zip(names, layers, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {n} has shape/dtype {tuple(t.shape)}/{t.dtype}; "
                                 f"expected {tuple(first.shape)}/{first.dtype} like {names[0]}")
            if not t[0].is_contiguous():
                raise ValueError(f"layer {n}: a block is not contiguous (strides {t.stride()})")
        bpb = first[0].numel() * first.element_size()
        return cls(names, layers, first.shape[0], bpb, first.dtype, _stacked_view(layers, bpb))

    def plane_spans(self) -> list[tuple[int, int]] | None:
        """``(address, nbytes)`` of each layer's blocks, in layer order, when every layer's blocks
        sit back to back (block ``b`` at ``address + b * bytes_per_block``); else None."""
        spans = []
        for t in self.layers:
            if t.stride(0) * t.element_size() != self.bytes_per_block:
                return None
            spans.append((t.data_ptr(), self.num_blocks * self.bytes_per_block))
        return spans

    def block_view(self, layer: int, block: int) -> torch.Tensor:
        """One block of one layer as flat uint8 (a view into the engine's cache)."""
        return self.layers[layer][block].reshape(-1).view(torch.uint8)


def _planes(kv_caches: Mapping[str, torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """Split FlashAttention's ``[2, num_blocks, block_size, heads, head]`` layers into K and V planes."""
    names: list[str] = []
    planes: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if t.dim() == 5 and t.shape[0] == 2:
            names += [f"{name}.k", f"{name}.v"]
            planes += [t[0], t[1]]
        else:
            names.append(name)
            planes.append(t)
    return names, planes


def _stacked_view(layers: Sequence[torch.Tensor], bpb: int) -> torch.Tensor | None:
    """``[L, num_blocks, bpb]`` uint8 view when layers sit at a constant stride in one buffer."""
    first = layers[0]
    es = first.element_size()
    if first.stride(0) * es != bpb:                       # blocks must be back-to-back within a layer
        return None
    ptrs = [t.data_ptr() for t in layers]
    step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else first.shape[0] * bpb
    if step <= 0 or step % es or any(b - a != step for a, b in zip(ptrs, ptrs[1:], strict=False)):
        return None
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in layers):
        return None
    storage = first.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    offset = ptrs[0] - storage.data_ptr()
    return flat.as_strided((len(layers), first.shape[0], bpb), (step, bpb, 1), offset)


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
    from kernels import cuda

    return cuda.available()


def gather(layout: KVLayout, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dispatch: the CUDA kernel where the layout allows it, else the reference."""
    if _fast_path(layout):
        from kernels import cuda

        return cuda.gather(layout, block_ids, out)
    return gather_ref(layout, block_ids, out)


def gather_to_host(layout: KVLayout, block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer as one new ``[L, n, bytes_per_block]`` uint8 CPU tensor
    (:func:`gather_into_host` into a fresh buffer)."""
    out = torch.empty((layout.num_layers, len(block_ids), layout.bytes_per_block), dtype=torch.uint8)
    return gather_into_host(layout, block_ids, out)


def gather_into_host(layout: KVLayout, block_ids: list[int], out: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer into ``out``, a host ``[L, n, bytes_per_block]`` uint8
    buffer the caller owns (and reuses: see :mod:`prefill.staging`); returns ``out``.

    A host cache gathers straight into ``out``; a device cache gathers on the device, then
    copies once into ``out``.
    """
    ids = torch.tensor(block_ids, dtype=torch.int64, device=layout.device)
    if layout.device.type == "cpu":
        return gather(layout, ids, out)
    dev = torch.empty(out.shape, dtype=torch.uint8, device=layout.device)
    out.copy_(gather(layout, ids, dev))
    return out


def gather_record(layout: KVLayout, block_ids: list[int], key: bytes, chunk_index: int) -> bytearray:
    """Chunk ``chunk_index`` (blocks ``block_ids`` of every layer) gathered straight into a new
    store record (:func:`transport.store.records.build_record`: one buffer, one copy)."""
    shape = (layout.num_layers, len(block_ids), layout.bytes_per_block)

    def fill(dst: memoryview) -> None:
        gather_into_host(layout, block_ids, torch.frombuffer(dst, dtype=torch.uint8).view(shape))

    return build_record(key, chunk_index, layout.chunk_bytes(len(block_ids)), fill, num_layers=shape[0],
                        num_blocks=shape[1])


def record_payload(layout: KVLayout, record: bytearray, n_blocks: int) -> torch.Tensor:
    """The payload of a record made by :func:`gather_record`, ``[L, n, bytes_per_block]`` uint8 (a view)."""
    view = torch.frombuffer(memoryview(record)[HEADER_SIZE:], dtype=torch.uint8)
    return view.view(layout.num_layers, n_blocks, layout.bytes_per_block)


def scatter(layout: KVLayout, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Dispatch: the CUDA kernel where the layout allows it, else the reference."""
    if _fast_path(layout):
        from kernels import cuda

        cuda.scatter(layout, block_ids, src)
        return
    scatter_ref(layout, block_ids, src)
