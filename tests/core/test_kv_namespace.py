"""A request's KV namespace (core/kv_namespace.py) and the keys it scopes (common/keys.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from kvrelay.common.keys import Fingerprint, chunk_keys, scoped_digest
from kvrelay.core.kv_namespace import adapter_digest, kv_namespace, opaque_prompt

FP = Fingerprint("m", "float32", "cpu:[4,128,128]", 128, 4, 65536)
TOKENS = list(range(600))


def lora(name: str, path: Path) -> SimpleNamespace:
    return SimpleNamespace(lora_request=SimpleNamespace(lora_name=name, lora_path=str(path)))


def adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_the_base_model_keeps_the_engines_keys_and_each_adapter_gets_its_own(tmp_path: Path):
    base = SimpleNamespace(lora_request=None)
    a, b = adapter(tmp_path / "a", b"\x01" * 64), adapter(tmp_path / "b", b"\x02" * 64)
    assert kv_namespace(base) == b"" and scoped_digest(FP.digest()) == FP.digest()
    keys = {name: chunk_keys(TOKENS, FP, 256, kv_namespace(req)) for name, req in
            {"base": base, "a": lora("a", a), "b": lora("b", b), "a-as-b": lora("b", a)}.items()}
    assert keys["base"] == chunk_keys(TOKENS, FP, 256)
    assert len({k[0] for k in keys.values()}) == 4, "every adapter (name and weights) keys apart"
    assert chunk_keys(TOKENS, FP, 256, kv_namespace(lora("a", a))) == keys["a"], "deterministic"


def test_new_weights_under_the_same_name_and_path_change_the_namespace(tmp_path: Path):
    a = adapter(tmp_path / "a", b"\x01" * 64)
    before = kv_namespace(lora("a", a))
    (a / "adapter_model.safetensors").write_bytes(b"\x03" * 64)
    os.utime(a / "adapter_model.safetensors", ns=(1, 1))
    assert kv_namespace(lora("a", a)) != before
    copy = adapter(tmp_path / "copy", b"\x03" * 64)
    assert adapter_digest(str(copy)) == adapter_digest(str(a)), "the digest is of the contents, not the path"


def test_an_unreadable_adapter_is_still_keyed_apart_from_the_base(tmp_path: Path):
    ns = kv_namespace(lora("hub", tmp_path / "missing"))
    assert ns.startswith(b"lora:hub:unknown:")


def test_images_and_prompt_embeddings_make_a_prompt_opaque():
    assert not opaque_prompt(SimpleNamespace(mm_features=[], prompt_embeds=None))
    assert opaque_prompt(SimpleNamespace(mm_features=[object()], prompt_embeds=None))
    assert opaque_prompt(SimpleNamespace(mm_features=[], prompt_embeds=object()))
