"""Helpers only tests use (kept out of the shipped packages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvrelay.common.errors import TransferTimeout
from kvrelay.common.wire import Buffer, make_header
from kvrelay.kernels.blocks import gather_into_host
from kvrelay.kernels.layout import KVLayout
from kvrelay.store.records import RECORD_TAG
from kvrelay.transport.events import ChunkArrival, TransferDone, TransferFailed


def gather_to_host(layout: KVLayout, block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer as one new ``[L, n, bytes_per_block]`` uint8 CPU tensor."""
    out = torch.empty((layout.num_layers, len(block_ids), layout.bytes_per_block), dtype=torch.uint8)
    return gather_into_host(layout, block_ids, out)


def make_record(key: bytes, chunk_index: int, payload: Buffer, *, num_layers: int, num_blocks: int) -> bytes:
    """One stored chunk: header + ``payload`` (``[num_layers][num_blocks]`` whole blocks)."""
    return make_header(key, RECORD_TAG, chunk_index, [payload], num_layers=num_layers,
                       num_blocks=num_blocks).pack() + bytes(payload)


def consume_transfer(receiver: Any, tid: str, on_chunk: Callable[[int, bytes], None], timeout_s: float = 10) -> Any:
    """Take transfer ``tid``'s events from ``receiver`` until it ends: each arrival's payload
    goes to ``on_chunk(index, bytes)`` and its slot back; returns the final event (TransferDone,
    TransferFailed) or the TransferTimeout raised. Always finishes the transfer."""
    try:
        while True:
            ev = receiver.next_event(tid, timeout_s)
            if isinstance(ev, ChunkArrival):
                on_chunk(ev.chunk_index, bytes(receiver.payload(ev)))
                receiver.release(ev)
            elif isinstance(ev, TransferDone | TransferFailed):
                return ev
    except TransferTimeout as exc:
        return exc
    finally:
        receiver.finish(tid)
