"""The fingerprint covers everything that changes KV bytes, so a redeploy never reads old KV.

Before: ``chunk_tokens``, the weights and the KV-relevant engine settings were not in it, so a
node redeployed with new weights (same path) or another quantization loaded the old
deployment's records from the disk and Redis tiers under the same keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.common.keys import chunk_keys  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core.fingerprint import engine_fingerprint  # noqa: E402
from kvrelay.kernels.layout import KVLayout  # noqa: E402


def vllm_config(model: str, **over: object) -> SimpleNamespace:
    mc = {"model": model, "revision": None, "quantization": None, "hf_overrides": {},
          "hf_config": SimpleNamespace(rope_scaling=None)}
    cc = {"block_size": 16, "cache_dtype": "auto"}
    for key, value in over.items():
        (cc if key == "cache_dtype" else mc)[key] = value
    return SimpleNamespace(model_config=SimpleNamespace(**mc), cache_config=SimpleNamespace(**cc),
                           parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return tmp_path


def test_everything_that_changes_kv_changes_the_keys(model_dir: Path):
    layout = KVLayout.from_caches({f"layers.{i}": torch.zeros(4, 2, 16, 32) for i in range(2)})
    cfg = kcfg.from_dict({})
    tokens = list(range(600))

    def keys(vc: SimpleNamespace, c: kcfg.KVRelayConfig = cfg) -> list[bytes]:
        return chunk_keys(tokens, engine_fingerprint(vc, layout, c), c.chunk_tokens)

    base = keys(vllm_config(str(model_dir)))
    assert keys(vllm_config(str(model_dir))) == base                        # stable
    variants = {
        "quantization": vllm_config(str(model_dir), quantization="fp8"),
        "rope scaling": vllm_config(str(model_dir), hf_config=SimpleNamespace(rope_scaling={"factor": 2.0})),
        "hf_overrides": vllm_config(str(model_dir), hf_overrides={"num_kv_heads": 2}),
        "kv cache dtype": vllm_config(str(model_dir), cache_dtype="fp8_e4m3"),
    }
    for what, vc in variants.items():
        assert keys(vc)[0] != base[0], what
    assert keys(vllm_config(str(model_dir)), kcfg.from_dict({"store": {"epoch": 1}}))[0] != base[0]
    assert keys(vllm_config(str(model_dir)), kcfg.from_dict({"chunk_tokens": 512}))[0] != base[0]


def test_new_weights_at_the_same_path_change_the_keys(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    layout = KVLayout.from_caches({"layers.0": torch.zeros(4, 2, 16, 32)})
    before = engine_fingerprint(vllm_config(str(model_dir)), layout)
    other = tmp_path_factory.mktemp("retrained")                       # the redeploy: same shapes, new values
    (other / "config.json").write_text('{"hidden_size": 64}')
    (other / "model.safetensors").write_bytes(bytes(reversed(range(256))) * 64)
    after = engine_fingerprint(vllm_config(str(other)), layout)
    assert dataclasses.replace(after, model=before.model).digest() != before.digest()
    hub = engine_fingerprint(vllm_config("org/model", revision="abc123"), layout)
    assert hub.weights == "rev:abc123"
    assert engine_fingerprint(vllm_config("org/model", revision="def456"), layout).digest() != hub.digest()


def test_store_records_are_per_layout_and_transfers_are_not(model_dir: Path):
    """The store's keys name the rank and the TP size (a TP2 rank never reads a TP1 engine's
    record, nor its sibling rank's); the transfer fingerprint does not, so TP2 and TP1 ranks
    can exchange pieces (core/rank_view.py)."""
    from kvrelay.core.rank_view import RankView

    cfg = kcfg.from_dict({"engine": {"prefill_tp": 2}})
    tokens = list(range(600))
    vc = vllm_config(str(model_dir))
    tp1 = KVLayout.from_caches({f"layers.{i}": torch.zeros(4, 4, 16, 32) for i in range(2)})    # 4 heads
    tp2 = KVLayout.from_caches({f"layers.{i}": torch.zeros(4, 2, 16, 32) for i in range(2)})    # 2 of 4 heads
    one = engine_fingerprint(vc, tp1, cfg)
    ranks = [engine_fingerprint(SimpleNamespace(
        **{**vars(vc), "parallel_config": SimpleNamespace(rank=r, tensor_parallel_size=2)}), tp2, cfg) for r in (0, 1)]
    keys = {fp: chunk_keys(tokens, fp, cfg.chunk_tokens)[0] for fp in (one, *ranks)}
    assert len(set(keys.values())) == 3                                  # three layouts, three records
    vc2 = SimpleNamespace(**{**vars(vc), "parallel_config": SimpleNamespace(rank=1, tensor_parallel_size=2),
                             "model_config": SimpleNamespace(**{**vars(vc.model_config),
                                                                "get_total_num_kv_heads": lambda: 4})})
    vc1 = SimpleNamespace(**{**vars(vc), "model_config": vc2.model_config})
    d = RankView.of(vc1, tp1, kcfg.from_dict({"engine": {"prefill_tp": 2}}), "decode")
    p = RankView.of(vc2, tp2, cfg, "prefill")
    assert d.transfer_fingerprint(one, tp1).digest() == p.transfer_fingerprint(ranks[1], tp2).digest()


def test_an_unpinned_hub_model_is_its_resolved_snapshot_commit(tmp_path: Path):
    """``--model org/name`` without ``--revision``: the identity is the snapshot commit the hub
    cache resolves ``main`` to, so weights updated on the hub are other KV (before the fix the
    identity was "" and restarted nodes reused the old weights' disk and Redis records)."""
    from kvrelay.core.fingerprint import weights_identity

    repo = tmp_path / "hub" / "models--org--name"

    def publish(commit: str) -> None:
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    publish("a" * 40)
    first = weights_identity("org/name", None, hub_cache=str(tmp_path / "hub"))
    assert first == f"hub:{'a' * 40}"
    publish("b" * 40)                                   # the hub moved on; the node restarts and downloads
    assert weights_identity("org/name", None, hub_cache=str(tmp_path / "hub")) == f"hub:{'b' * 40}"
    assert weights_identity("org/name", "a" * 40, hub_cache=str(tmp_path / "hub")) == first
    assert weights_identity("org/absent", None, hub_cache=str(tmp_path / "hub")) == ""


def test_a_change_anywhere_in_a_weight_file_changes_the_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The whole file is hashed, not its first and last MiB (before the fix a retrained model of the
    same size and with the same ends kept the old identity); the digest is remembered across
    restarts in the user's cache, keyed by size, mtime, ctime and inode."""
    from kvrelay.core import fingerprint

    monkeypatch.setattr(fingerprint, "DIGEST_CACHE", tmp_path / "cache" / "digests.json")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = bytearray(b"\0" * (3 << 20))
    (model / "model.safetensors").write_bytes(weights)
    before = fingerprint.weights_identity(str(model), None)
    weights[len(weights) // 2] = 1                       # the middle MiB only: same size, same ends
    (model / "model.safetensors").write_bytes(weights)
    fingerprint._file_digest.cache_clear()               # a restarted process
    after = fingerprint.weights_identity(str(model), None)
    assert after != before and after.startswith("files:")
    assert (tmp_path / "cache" / "digests.json").stat().st_mode & 0o777 == 0o600
    fingerprint._file_digest.cache_clear()
    assert fingerprint.weights_identity(str(model), None) == after          # from the cache, unchanged


def test_a_cpu_fingerprint_names_the_attention_isa(model_dir: Path):
    """vLLM's CPU backend writes its cache per ISA (AMX, AVX-512 "vec", NEON...): engines on hosts
    with different ISAs must exchange no KV (before the fix the ISA was not in the fingerprint)."""
    from kvrelay.core.fingerprint import cpu_attention_isa

    layout = KVLayout.from_caches({"layers.0": torch.zeros(4, 2, 16, 32)})
    vc = vllm_config(str(model_dir))
    vc.model_config.get_head_size = lambda: 16
    amx, vec = (engine_fingerprint(vc, layout, isa=isa) for isa in ("amx", "vec"))
    assert amx.kv_layout.endswith(":amx") and amx.digest() != vec.digest()
    here = cpu_attention_isa(vc, layout)
    assert here not in ("", "unknown")                       # vLLM's own choice on this host
    assert engine_fingerprint(vc, layout).kv_layout.endswith(f":{here}")
