"""How a chunk leaves the prefill node: its payload, its header, and the buffer kept until written.

How a chunk leaves is the backend's call, not a branch on its name: a backend with
``capabilities.registered_layout`` gets the host KV cache registered once and each chunk
named by its block ids (no copy); any other gets the chunk gathered into one host buffer
(a resident one lent by :mod:`kvrelay.prefill.staging`, taken back when the write is done).
A chunk already gathered for the store is sent from that record's payload, and its header
reuses the record's checksum: a chunk that is stored and pushed is hashed once.

``connector.push_hook`` (``"module:function"``) sees every chunk after its header (and
checksum) is built and returns the bytes to send: tests install their fault injection
this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.common.wire import DataMac, DType, make_header
from kvrelay.core.hooks import load_function
from kvrelay.kernels.blocks import gather_into_host
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span
from kvrelay.prefill.staging import Staged, StagingPool
from kvrelay.transport.backends.base import BlockPayload, MemRegion, Payload, SourceLayout

_DTYPES = {torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16, torch.float32: DType.FLOAT32}
PushHook = Callable[[str, int, torch.Tensor], torch.Tensor]   # (transfer id, chunk, [L, n, bpb] bytes) -> bytes


def load_hook(spec: str) -> PushHook | None:
    """``"module:function"`` -> the function (None for ``""``)."""
    hook: PushHook | None = load_function(spec, "connector.push_hook")
    return hook


def source_layout(layout: KVLayout) -> SourceLayout | None:
    """The host KV cache as registrable memory: one region per layer of back-to-back blocks."""
    spans = layout.plane_spans()
    if layout.device.type != "cpu" or spans is None:
        return None
    return SourceLayout(tuple(MemRegion(addr, n) for addr, n in spans), layout.bytes_per_block)


@dataclass(frozen=True)
class SavedChunk:
    """A chunk the store just saved: its record's payload (``[L, n, bpb]`` uint8, a view the
    push may send but must not change) and that payload's checksum."""

    payload: torch.Tensor
    payload_sum: int


@dataclass(frozen=True)
class ChunkBuffer:
    """What a chunk in flight keeps alive until its write settles."""

    staged: Staged | None = None          # a staging buffer: given back when written, else retired
    tensor: torch.Tensor | None = None    # a stored record's payload, or what the push hook returned


@dataclass(frozen=True)
class Chunk:
    """One chunk to push: where it comes from and what it is called."""

    key: bytes
    transfer_id: str
    index: int
    block_ids: list[int]
    saved: SavedChunk | None = None       # the store gathered it already
    span: Span | None = None              # the heads sent of each block (kernels.blocks.Span); None = whole


class PayloadMaker:
    """Builds each chunk's (payload, header, buffer to keep). ``staging`` is set once the KV
    caches are registered (its slots are a chunk's size)."""

    def __init__(self, hook: PushHook | None, mac: DataMac | None = None) -> None:
        self.hook, self.mac = hook, mac           # mac: transport.data_mac's signer (None: off)
        self.staging: StagingPool | None = None

    def make(self, chunk: Chunk, layout: KVLayout, registered: bool) -> tuple[Payload, bytes, ChunkBuffer]:
        """``registered``: the sender's backend holds the KV cache registered (no copy needed)."""
        ids = chunk.block_ids

        def header(regions: list[Any], payload_sum: int | None = None) -> bytes:
            return make_header(chunk.key, chunk.transfer_id, chunk.index, regions, num_layers=layout.num_layers,
                               num_blocks=len(ids), dtype=_DTYPES.get(layout.dtype, DType.OPAQUE),
                               payload_sum=payload_sum, mac=self.mac).pack()

        if chunk.saved is None and self.hook is None and registered and chunk.span is None:
            views = [layout.block_view(li, b).numpy().data for li in range(layout.num_layers) for b in ids]
            return BlockPayload(tuple(ids)), header(views), ChunkBuffer()     # straight from the KV cache
        if chunk.saved is not None:
            buf = chunk.saved.payload
            return self._hooked(chunk, buf, header([buf.numpy().data], chunk.saved.payload_sum), ChunkBuffer(tensor=buf))
        assert self.staging is not None
        span = chunk.span or Span.whole(layout.bytes_per_block)
        staged = self.staging.take((layout.num_layers, len(ids), span.nbytes))
        try:
            gather_into_host(layout, ids, staged.tensor, span)                      # [L, n, span] uint8
            return self._hooked(chunk, staged.tensor, header([staged.tensor.numpy().data]), ChunkBuffer(staged))
        except BaseException:
            self.staging.give_back(staged)          # nothing was sent from it
            raise

    def _hooked(self, chunk: Chunk, buf: torch.Tensor, hdr: bytes,
                keep: ChunkBuffer) -> tuple[Payload, bytes, ChunkBuffer]:
        """The push hook (if any) on ``buf``, after its header is made."""
        if self.hook is None:
            return [buf.numpy().data], hdr, keep
        hooked = self.hook(chunk.transfer_id, chunk.index, buf)
        return [hooked.numpy().data], hdr, ChunkBuffer(keep.staged, hooked)

    def release(self, keep: ChunkBuffer, done: bool) -> None:
        """A written (``done``) or abandoned chunk's buffer: a staged one goes back to the pool,
        or, if its write may still read it, is retired."""
        if keep.staged is not None and self.staging is not None:
            if done:
                self.staging.give_back(keep.staged)
            else:
                self.staging.retire(keep.staged)
