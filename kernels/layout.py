"""``KVLayout``: vLLM's per-layer KV cache tensors seen as planes of opaque blocks.

vLLM hands a connector one KV tensor per attention layer. :class:`KVLayout` turns
them into *planes*, each ``[num_blocks, ...]`` with a contiguous block, and copies
whole blocks of every plane as opaque bytes (never per token: on CPU K sits
transposed inside a block). The shapes vLLM's backends use:

* vLLM >= 0.32 (RFC #42082): every layer is a *logical* ``[num_blocks, kv_heads, block_size,
  content]`` view whose strides give the physical order (``KVCacheLayout``): the CPU backend's
  is head-major (``LBHNC``: heads outside tokens, HND), FlashAttention's and FlashInfer's may be
  token-major (``LBNHC``: NHD). Each plane is taken in its *physical* order (dimensions after
  the block's sorted by stride), so a block is one contiguous run of bytes whatever the layout,
  and :attr:`KVLayout.heads_dim` says where the heads sit inside it;
* MLA: ``[num_blocks, block_size, dim]`` - one plane, no heads (every rank holds the latent);
* older FlashAttention: ``[2, num_blocks, block_size, kv_heads, head]`` (K and V apart) -
  two planes, ``[0]`` (K) and ``[1]`` (V), named ``<layer>.k`` / ``<layer>.v``.

When every layer is a view into one buffer at a constant stride (what vLLM allocates),
it builds one strided ``[L, num_blocks, bytes_per_block]`` uint8 view so a gather or
scatter over all layers is a single indexed copy (:mod:`kvrelay.kernels.blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvrelay.kernels.span import Span


@dataclass
class KVLayout:
    names: list[str]                 # layer names, in engine order
    layers: list[torch.Tensor]       # [num_blocks, ...] per layer, engine dtype
    num_blocks: int
    bytes_per_block: int
    dtype: torch.dtype
    stacked: torch.Tensor | None     # [L, num_blocks, bytes_per_block] uint8 view, if expressible
    heads_dim: int | None = None     # where the KV heads sit in block_shape() (None: no heads dim known)

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

    def head_runs(self) -> tuple[int, int] | None:
        """``(rows, head_bytes)``: a block read as ``rows`` runs (the dimensions outside the heads),
        each holding every head ``head_bytes`` wide; None: its blocks have no heads dimension."""
        shape, hd = self.block_shape(), self.heads_dim
        if hd is None:
            return None
        rows, inner = 1, self.layers[0].element_size()
        for n in shape[:hd]:
            rows *= n
        for n in shape[hd + 1:]:
            inner *= n
        return rows, inner

    def heads_span(self, h0: int, h1: int) -> Span:
        """Heads ``[h0, h1)`` of this layout's blocks (local head indices) as a :class:`Span`."""
        runs = self.head_runs()
        if runs is None:
            raise ValueError("this layout's blocks have no heads dimension: a head range cannot be cut from them")
        rows, unit = runs
        return Span(rows, self.bytes_per_block // rows, h0 * unit, (h1 - h0) * unit)

    @classmethod
    def from_caches(cls, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        names, logical = _planes(kv_caches)
        if not logical:
            raise ValueError("no KV cache tensors registered")
        physical = [physical_order(t) for t, _ in logical]
        layers = [t for t, _ in physical]
        first, heads_dim = layers[0], physical[0][1][logical[0][1]] - 1 if logical[0][1] else None
        for n, t in zip(names, layers, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {n} has shape/dtype {tuple(t.shape)}/{t.dtype}; "
                                 f"expected {tuple(first.shape)}/{first.dtype} like {names[0]}")
            if not t[0].is_contiguous():
                raise ValueError(f"layer {n}: a block is not one contiguous run of bytes (strides {t.stride()}): "
                                 "a KV cache layout with the heads or the layers outside the blocks")
        bpb = first[0].numel() * first.element_size()
        return cls(names, layers, first.shape[0], bpb, first.dtype, _stacked_view(layers, bpb), heads_dim)

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


def _planes(kv_caches: Mapping[str, torch.Tensor]) -> tuple[list[str], list[tuple[torch.Tensor, int | None]]]:
    """Each layer as ``(plane, its logical heads dimension)``: vLLM's ``[B, H, N, C]`` views have
    their heads at 1; older FlashAttention's ``[2, num_blocks, block_size, heads, head]`` layers are
    split into K and V planes with their heads at 2; others (MLA) have none."""
    names: list[str] = []
    planes: list[tuple[torch.Tensor, int | None]] = []
    for name, t in kv_caches.items():
        if t.dim() == 5 and t.shape[0] == 2:
            names += [f"{name}.k", f"{name}.v"]
            planes += [(t[0], 2), (t[1], 2)]
        else:
            names.append(name)
            planes.append((t, 1 if t.dim() == 4 else None))
    return names, planes


def physical_order(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``t`` ([num_blocks, ...]) with the dimensions after the first permuted into memory order
    (outermost first), and where each original dimension went. A view: no byte moves.

    vLLM expresses a physical layout as strides over one logical shape (an NHD cache is a
    ``[B, H, N, C]`` view whose H stride is smaller than its N stride); read in memory order,
    a block is contiguous and its bytes can be copied whole. Of two dimensions with one stride,
    the longer is the outer: a one-head NHD rank's ``[B, 1, N, C]`` view has equal strides for
    its heads and tokens, and is ``[tokens, 1, C]`` in memory, as its peers with more heads are."""
    inner = sorted(range(1, t.dim()), key=lambda d: (-t.stride(d), -t.shape[d], d))
    order = [0, *inner]
    return t.permute(order), [order.index(d) for d in range(t.dim())]


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
