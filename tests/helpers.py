"""Helpers only tests use (kept out of the shipped packages)."""

from __future__ import annotations

import torch
from kvrelay.common.wire import Buffer, make_header
from kvrelay.kernels.blocks import gather_into_host
from kvrelay.kernels.layout import KVLayout
from kvrelay.store.records import RECORD_TAG


def gather_to_host(layout: KVLayout, block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer as one new ``[L, n, bytes_per_block]`` uint8 CPU tensor."""
    out = torch.empty((layout.num_layers, len(block_ids), layout.bytes_per_block), dtype=torch.uint8)
    return gather_into_host(layout, block_ids, out)


def make_record(key: bytes, chunk_index: int, payload: Buffer, *, num_layers: int, num_blocks: int) -> bytes:
    """One stored chunk: header + ``payload`` (``[num_layers][num_blocks]`` whole blocks)."""
    return make_header(key, RECORD_TAG, chunk_index, [payload], num_layers=num_layers,
                       num_blocks=num_blocks).pack() + bytes(payload)
