"""``KVLayout``: vLLM's per-layer KV cache tensors seen as planes of opaque blocks.

vLLM hands a connector one KV tensor per attention layer. :class:`KVLayout` turns
them into *planes*, each ``[num_blocks, ...]`` with a contiguous block, and copies
whole blocks of every plane as opaque bytes (never per token: on CPU K sits
transposed inside a block). The shapes vLLM's backends use:

* CPU attention: ``[num_blocks, kv_heads, block_size, 2*head_size]`` - one plane;
* FlashInfer, MLA: ``[num_blocks, 2, block_size, heads, head]`` / ``[num_blocks,
  block_size, dim]`` - one plane (the block is the leading dimension);
* FlashAttention: ``[2, num_blocks, block_size, kv_heads, head]`` (K and V apart) -
  two planes, ``[0]`` (K) and ``[1]`` (V), named ``<layer>.k`` / ``<layer>.v``.

When every layer is a view into one buffer at a constant stride (what vLLM allocates),
it builds one strided ``[L, num_blocks, bytes_per_block]`` uint8 view so a gather or
scatter over all layers is a single indexed copy (:mod:`kvrelay.kernels.blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


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
