"""Engine configurations kvrelay refuses at start, naming the flag (core/engine_compat.py), from
an argument list (kvrelay up / serve / config --check) and from a running vLLM's config."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvrelay.common.errors import EngineIncompatible
from kvrelay.core import config as kcfg
from kvrelay.core.engine_compat import facts_from_args, facts_from_vllm, pair_refusals, refusals
from kvrelay.deploy.config_check import engine_problems


def flags(facts) -> list[str]:
    return [r.flag for r in refusals(facts)]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "medusa", "draft_model", "ngram"])
def test_speculative_decoding_is_refused(method: str):
    spec = json.dumps({"method": method, "model": "drafter", "num_speculative_tokens": 2})
    assert flags(facts_from_args(["--speculative-config", spec])) == [f"--speculative-config method {method!r}"]
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    assert "rejection sampler" in refusals(facts_from_args([f"--speculative-config={ngram}"]))[0].reason
    assert refusals(facts_from_args([])) == []
    assert flags(facts_from_args(["--speculative-config", json.dumps({"model": "d"})])) == [
        "--speculative-config method 'draft_model'"]


def test_a_kv_cache_in_another_dtype_than_the_models_is_refused():
    """Measured: a bfloat16 KV cache under a float32 model changed most answers (tests/differential/configs.py)."""
    assert refusals(facts_from_args(["--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16"])) == []
    assert refusals(facts_from_args(["--kv-cache-dtype", "bfloat16"], {"torch_dtype": "bfloat16"})) == []
    assert refusals(facts_from_args(["--kv-cache-dtype", "half", "--dtype", "float16"])) == []
    assert flags(facts_from_args(["--kv-cache-dtype", "bfloat16"], {"dtype": "float32"})) == [
        "--kv-cache-dtype bfloat16"]
    assert flags(facts_from_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])) == [
        "--calculate-kv-scales", "--kv-cache-dtype fp8"]
    for dtype in ("fp8", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4"):
        assert flags(facts_from_args(["--kv-cache-dtype", dtype, "--dtype", "bfloat16"])) == [
            f"--kv-cache-dtype {dtype}"]


@pytest.mark.parametrize(("hf", "flag"), [
    ({"model_type": "deepseek_v2", "kv_lora_rank": 512}, "model deepseek_v2 (kv_lora_rank)"),
    ({"model_type": "jamba"}, "model jamba (mamba / linear-attention layers)"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
     "model qwen3_next (mamba / linear-attention layers)"),
    ({"model_type": "llama4", "attention_chunk_size": 8192}, "model llama4 (attention_chunk_size)"),
])
def test_attention_that_is_not_a_per_token_kv_cache_is_refused(hf: dict, flag: str):
    assert flags(facts_from_args([], hf)) == [flag]


def test_alternating_windows_are_served_and_a_window_on_every_layer_is_refused():
    hf = {"model_type": "llama", "sliding_window": 256, "layer_types": ["sliding_attention", "full_attention"]}
    assert refusals(facts_from_args([], hf)) == []
    assert refusals(facts_from_args([], {"model_type": "qwen2", "sliding_window": 4096,
                                         "use_sliding_window": False})) == []
    every = {"model_type": "mistral", "sliding_window": 4096}
    assert flags(facts_from_args([], every)) == ["model mistral (sliding_window on every layer)"]
    assert flags(facts_from_args([], {**hf, "layer_types": ["sliding_attention"] * 2})) == [
        "model llama (sliding_window on every layer)"]


def test_prefill_and_decode_must_agree_on_blocks_and_kv_dtype():
    p, d = facts_from_args(["--block-size", "64"]), facts_from_args([])
    assert [r.flag for r in pair_refusals(p, d, 256)] == ["--block-size 64 (prefill) vs default (decode)"]
    assert pair_refusals(p, facts_from_args(["--block-size=64"]), 256) == []
    assert [r.flag for r in pair_refusals(facts_from_args(["--block-size", "96"]),
                                          facts_from_args(["--block-size", "96"]), 256)] == [
        "--block-size 96 (prefill)", "--block-size 96 (decode)"]
    kv = pair_refusals(facts_from_args(["--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16"]), d, 256)
    assert [r.flag for r in kv] == ["--kv-cache-dtype bfloat16 (prefill) vs auto (decode)"]


def test_config_check_reads_the_model_dtype_from_engine_dtype_too():
    """``engine.dtype`` reaches vLLM as ``--dtype``: a KV cache in it is the model's, not another dtype."""
    same = kcfg.from_dict({"engine": {"dtype": "bfloat16", "extra_args": ["--kv-cache-dtype", "bfloat16"]}})
    assert engine_problems(same) == []
    other = kcfg.from_dict({"engine": {"dtype": "float32", "extra_args": ["--kv-cache-dtype", "bfloat16"]}})
    assert any("--kv-cache-dtype bfloat16" in p for p in engine_problems(other))


def test_config_check_names_the_flag_and_serve_refuses_before_vllm_starts(tmp_path):
    cfg = kcfg.from_dict({"engine": {"extra_args": ["--speculative-config", '{"method": "eagle", "model": "x"}'],
                                     "decode_args": ["--block-size", "64"]}})
    found = engine_problems(cfg)
    assert len(found) == 2 and "method 'eagle'" in found[0] and "--block-size" in found[1]
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    run = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", "decode", "--dry-run",
                          f"--transport.secret-file={secret}", "--engine.decode-args=--kv-cache-dtype fp8_inc"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--kv-cache-dtype fp8_inc" in run.stderr, run.stderr


def test_an_engine_started_by_hand_is_refused_when_vllm_builds_the_connector():
    pytest.importorskip("vllm")
    from kvrelay.core.connector_base import refuse_incompatible

    def vllm_config() -> SimpleNamespace:
        hf = SimpleNamespace(to_dict=lambda: {"model_type": "llama"})
        return SimpleNamespace(cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"),
                               model_config=SimpleNamespace(hf_text_config=hf, dtype="torch.float32"),
                               speculative_config=SimpleNamespace(method="eagle3"))
    with pytest.raises(EngineIncompatible, match="method 'eagle3'"):
        refuse_incompatible(vllm_config())
    ok = vllm_config()
    ok.speculative_config = None
    refuse_incompatible(ok)
    assert facts_from_vllm(ok).speculative_method is None
    with pytest.raises(EngineIncompatible, match="--kv-cache-dtype bfloat16"):
        refuse_incompatible(SimpleNamespace(cache_config=SimpleNamespace(block_size=128, cache_dtype="bfloat16"),
                                            speculative_config=None,
                                            model_config=SimpleNamespace(hf_text_config=None, dtype="torch.float32")))
    groups = SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(EngineIncompatible, match="2 KV-cache groups"):
        refuse_incompatible(ok, groups)
