"""The decode node's receive pool is sized from the engine: auto by default, and a configured
pool that cannot hold one maximal prompt fails at start-up, not on every long request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.common.errors import ConfigError  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.decode.installer import InstallWorker  # noqa: E402
from kvrelay.transport.pool import AUTO_POOL_MIN_BYTES, receive_pool_bytes  # noqa: E402

MiB = 1 << 20


def test_auto_pool_holds_two_maximal_prompts_and_at_least_the_floor():
    slot = 16 * MiB + 128                       # an 8B model's 512-token chunk, roughly
    size = receive_pool_bytes(0, slot, max_model_len=8192, chunk_tokens=512)
    assert size >= 2 * 16 * slot                # 16 chunks per prompt, two prompts
    assert receive_pool_bytes(0, 4096, max_model_len=256, chunk_tokens=256) == AUTO_POOL_MIN_BYTES
    assert receive_pool_bytes(1 << 30, 2 * MiB + 128, 4096, 256) == 1 << 30


def test_a_pool_that_cannot_hold_one_maximal_prompt_fails_at_start_up():
    with pytest.raises(ConfigError, match="max_model_len=8192"):
        receive_pool_bytes(256 * MiB, 16 * MiB + 128, max_model_len=8192, chunk_tokens=512)
    cfg = kcfg.load(overrides=["chunk_tokens=32", "transport.backend=tcp", "transport.pool_bytes=64KiB",
                               "connector.helper_cpus=inherit"])
    vc = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                         model_config=SimpleNamespace(model="t", max_model_len=4096),
                         parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1),
                         kv_transfer_config=SimpleNamespace(engine_id="pool-test"))
    worker = InstallWorker(cfg, vc)
    caches = {f"l{i}": t for i, t in enumerate(torch.zeros((2, 64, 2, 16, 32)))}
    try:
        with pytest.raises(ConfigError, match="cannot hold one prompt"):
            worker.register(caches)
    finally:
        worker.close()
