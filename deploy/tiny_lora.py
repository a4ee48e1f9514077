"""``kvrelay make-tiny-lora DIR``: a deterministic PEFT LoRA adapter for the tiny model.

vLLM serves it with ``--enable-lora --lora-modules NAME=DIR --max-lora-rank 8``. It has a
rank-``rank`` update on the q, k, v and o projections of every layer, so it changes every
layer's K and V: the KV of a prompt under the adapter differs from the base model's, and
an answer computed from the wrong one differs (the LoRA compatibility tests rely on this).
Different ``seed`` values give different adapters; the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.deploy.tiny_model import HEAD_DIM, KV_HEADS, LAYERS, WIDTHS

RANK = 8
SCALE = 0.5          # lora_B's spread: large enough to move greedy answers, small enough to stay text
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shapes(hidden: int, heads: int) -> dict[str, tuple[int, int]]:
    """``proj -> (in, out)`` features of the tiny model's attention projections."""
    return {"q_proj": (hidden, heads * HEAD_DIM), "k_proj": (hidden, KV_HEADS * HEAD_DIM),
            "v_proj": (hidden, KV_HEADS * HEAD_DIM), "o_proj": (heads * HEAD_DIM, hidden)}


def make_tiny_lora(out_dir: str | Path, seed: int = 1, rank: int = RANK, width: str = "narrow") -> Path:
    """Write adapter ``seed`` for the tiny model of ``width`` into ``out_dir``; return its path."""
    import torch
    from safetensors.torch import save_file

    hidden, heads, _ = WIDTHS[width]
    gen = torch.Generator().manual_seed(10_000 + seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for proj, (d_in, d_out) in _shapes(hidden, heads).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * SCALE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(_PROJ), "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": "kvrelay-tiny"}, indent=2, sort_keys=True) + "\n")
    return out
