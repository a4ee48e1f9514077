"""The engine fingerprint: what makes KV bytes exchangeable between two engines."""

from __future__ import annotations

from typing import Any

from transport.keys import Fingerprint


def engine_fingerprint(vllm_config: Any, layout: Any) -> Fingerprint:
    """Model, dtype, KV layout, block size and TP rank of this worker (see transport.keys.Fingerprint).

    ``layout`` is the worker's :class:`kernels.blocks.KVLayout`."""
    pc = vllm_config.parallel_config
    return Fingerprint(model=str(vllm_config.model_config.model), dtype=str(layout.dtype),
                       kv_layout=f"{layout.device.type}:{list(layout.block_shape())}",
                       block_size=vllm_config.cache_config.block_size, num_layers=layout.num_layers,
                       bytes_per_block=layout.bytes_per_block, tp_rank=getattr(pc, "rank", 0),
                       tp_size=pc.tensor_parallel_size)
