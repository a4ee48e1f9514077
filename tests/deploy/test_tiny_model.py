"""The built-in tiny model: deterministic, and its variants share one KV layout."""

from __future__ import annotations

import json

import pytest

from kvrelay.deploy.tiny_model import ensure_tiny_model, make_tiny_model


def _cfg(path) -> dict:
    return dict(json.loads((path / "config.json").read_text()))


def test_variants_share_the_kv_layout_and_rebuild_on_mismatch(tmp_path):
    narrow = make_tiny_model(tmp_path / "n")
    first = (narrow / "model.safetensors").read_bytes()
    assert (make_tiny_model(narrow) / "model.safetensors").read_bytes() == first     # deterministic
    wide = ensure_tiny_model(tmp_path / "w", "wide")
    a, b = _cfg(narrow), _cfg(wide)
    for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size", "torch_dtype"):
        assert a.get(k) == b.get(k), k                      # same chunks, keys and transfer sizes
    assert b["hidden_size"] == 4 * a["hidden_size"] and b["intermediate_size"] == 8 * a["intermediate_size"]
    assert b["num_attention_heads"] == 4 * b["num_key_value_heads"]                    # GQA 4:1
    # a directory holding the other variant is rebuilt, not silently reused
    again = ensure_tiny_model(tmp_path / "w", "narrow")
    assert _cfg(again)["hidden_size"] == a["hidden_size"]
    assert (again / "model.safetensors").read_bytes() == first
    with pytest.raises(ValueError, match="unknown tiny-model width"):
        make_tiny_model(tmp_path / "x", "huge")
