"""Store records gathered straight from the engine's KV cache (the kernels meet the store here).

The kernels move opaque blocks and know nothing of records; the store owns the record
format and knows nothing of engines. :func:`gather_record` joins them: one buffer and one
copy per saved chunk (:func:`kvrelay.store.records.build_record`).
"""

from __future__ import annotations

import torch

from kvrelay.common.wire import HEADER_SIZE
from kvrelay.kernels.blocks import gather_into_host
from kvrelay.kernels.layout import KVLayout
from kvrelay.store.records import build_record


def gather_record(layout: KVLayout, block_ids: list[int], key: bytes, chunk_index: int) -> bytearray:
    """Chunk ``chunk_index`` (blocks ``block_ids`` of every layer) gathered straight into a new
    store record (:func:`kvrelay.store.records.build_record`: one buffer, one copy)."""
    shape = (layout.num_layers, len(block_ids), layout.bytes_per_block)

    def fill(dst: memoryview) -> None:
        gather_into_host(layout, block_ids, torch.frombuffer(dst, dtype=torch.uint8).view(shape))

    return build_record(key, chunk_index, layout.chunk_bytes(len(block_ids)), fill, num_layers=shape[0],
                        num_blocks=shape[1])


def record_payload(layout: KVLayout, record: bytearray, n_blocks: int) -> torch.Tensor:
    """The payload of a record made by :func:`gather_record`, ``[L, n, bytes_per_block]`` uint8 (a view)."""
    view = torch.frombuffer(memoryview(record)[HEADER_SIZE:], dtype=torch.uint8)
    return view.view(layout.num_layers, n_blocks, layout.bytes_per_block)
