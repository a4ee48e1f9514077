"""Mixed TP over the GPU block layouts, through the real worker halves on CPU tensors.

vLLM (>= 0.32) hands a connector every layer as a logical ``[blocks, kv_heads, block_size,
content]`` view; the physical order is in the strides. Its CPU backend is head-major (HND:
``LBHNC``); FlashAttention and FlashInfer on GPUs may be token-major (NHD: ``LBNHC``), where a
block holds every head of one token before the next token. Each rank's cache here is a CPU
tensor laid out and strided exactly so (:mod:`tests.gpu.halves`), and the real prefill worker
ranks push over a real tcp transport into the real decode worker ranks at another TP size.
What each decode rank holds is compared, byte for byte, with its heads of the unsplit KV.
"""

from __future__ import annotations

import pytest

from tests.gpu.halves import run_pair


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 4), (4, 1)], ids=["p2-d4", "p4-d1"])
def test_mixed_tp_over_gpu_block_layouts_is_byte_exact(layout: str, tp_p: int, tp_d: int) -> None:
    result = run_pair(layout, tp_p, tp_d, seed=tp_p * 10 + tp_d)
    assert result.exact, result.mismatches
