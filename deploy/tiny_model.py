"""``kvrelay make-tiny-model DIR``: a small, deterministic Llama checkpoint + tokenizer.

Models cannot be downloaded on the machines this project is developed on, so the
stack ships its own. The checkpoint is a real ``LlamaForCausalLM`` (random weights
from a fixed seed) that vLLM loads like any Hugging Face model:

* **KV-heavy**: 4 layers x 4 KV heads x head_dim 64 in float32 = 8 KiB of KV per token,
  so one 256-token chunk is exactly 2 MiB and transfers are not trivially small.
* **float32**: served with ``--dtype float32`` (the launcher does this for the tiny
  model). In bf16 a decode step over pushed KV and a full prefill round differently
  often enough to flip near-tied greedy choices of a random model; in fp32 they agree.
* **Character tokenizer**: one token per printable ASCII character (space and
  newline included), so "a prompt of N tokens" is simply N characters.
* **Context-sensitive**: attention weights are scaled up so the next token depends
  on tokens far back in the prompt (changing the first 20 of 600 tokens changes the
  greedy continuation) - corrupting an early KV chunk therefore changes the output.
* **Confident logits**: the LM head is scaled so that the top logit is far above the
  runner-up; greedy decoding is then stable against bf16 rounding differences
  between a prefill pass and a decode pass, which token-exact PD tests rely on.
  Rows of special tokens are zeroed so generation never stops early or emits
  non-text.

Writing the same directory twice gives byte-identical files.

**Attention kinds.** ``attention="sliding"`` makes every layer attend to the last
``WINDOW`` tokens only (Mistral-style sliding window); ``attention="alternating"``
alternates sliding and full layers (Gemma-2/3-style: vLLM's hybrid KV-cache groups). Both
are the same Llama checkpoint with ``layer_types`` and ``sliding_window`` in its config, so
the compatibility tests change one thing at a time.

**Variants.** ``width="wide"`` (``kvrelay make-tiny-model DIR --wide``) keeps the KV
layout above (so chunks, keys and transfers are identical) but has a 1,024-wide
residual stream, 16 query heads sharing the 4 KV heads (GQA 4:1) and a 4,096-wide
MLP: 61 M parameters instead of 3 M. Its compute per token is then dominated by the
linear layers, as in real models, instead of by attention. The default model is
~400 parameters per KV byte per token; Llama-3-8B is ~60,000; the wide variant is
~7,500 - still far more KV-heavy than a real model, so reuse benchmarks on it
understate rather than overstate what loading saves.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]
LAYERS, KV_HEADS, HEAD_DIM = 4, 4, 64          # the KV layout: identical in every variant
WIDTHS = {  # variant -> (hidden size, query heads, MLP width)
    "narrow": (256, 4, 512),
    "wide": (1024, 16, 4096),
}
VOCAB_SIZE = 128            # 4 specials + 97 characters, padded
MAX_POSITIONS = 4096       # its context length: what vLLM serves it at when engine.max_model_len is unset
POSITIONS = {"narrow": MAX_POSITIONS, "wide": 8192}   # per variant: the wide one serves `bench multiturn`'s histories
WINDOW = 256                # the sliding window of the "sliding" and "alternating" attention kinds
ATTENTION = ("full", "sliding", "alternating")
SEED = 1234
LOGIT_SCALE = 40.0
ATTN_SCALE, QK_SCALE = 10.0, 3.0    # attention dominates the residual: output depends on far context
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_char(b: int) -> str:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, others are shifted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def _vocab() -> dict[str, int]:
    chars = [_byte_char(b) for b in [ord("\n"), ord(" ")] + list(range(ord("!"), ord("~") + 1))]
    return {tok: i for i, tok in enumerate(SPECIALS + chars)}


def _write_tokenizer(out: Path, positions: int = MAX_POSITIONS) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": False,
        "model_max_length": positions, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=2) + "\n")


def _layer_types(attention: str) -> dict[str, object]:
    """Config entries that make ``attention``'s layers slide (none for full attention)."""
    if attention == "full":
        return {}
    kinds = ["sliding_attention" if attention == "sliding" or i % 2 == 0 else "full_attention"
             for i in range(LAYERS)]
    return {"layer_types": kinds, "sliding_window": WINDOW}


def _write_model(out: Path, width: str, attention: str = "full") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, intermediate = WIDTHS[width]
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=POSITIONS[width], rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=1, pad_token_id=3,
                      tie_word_embeddings=False, dtype="float32", **_layer_types(attention))
    torch.manual_seed(SEED)
    with torch.no_grad():
        model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(ATTN_SCALE)
            attn.o_proj.weight.mul_(ATTN_SCALE)
            attn.q_proj.weight.mul_(QK_SCALE)
            attn.k_proj.weight.mul_(QK_SCALE)
        model.lm_head.weight.mul_(LOGIT_SCALE)
        model.lm_head.weight[: len(SPECIALS)] = 0          # never generate specials / EOS
        model.lm_head.weight[len(_vocab()):] = 0           # nor padding ids
    model.save_pretrained(str(out), safe_serialization=True)
    # save_pretrained adds generation defaults; keep them minimal and deterministic.
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3}, indent=2) + "\n")


def _marker(width: str, attention: str = "full") -> str:
    hidden, heads, intermediate = WIDTHS[width]
    kind = "" if attention == "full" else f", {attention} attention (window {WINDOW})"
    return (f"kvrelay tiny Llama ({width}): {LAYERS} layers, {KV_HEADS} kv heads x {HEAD_DIM}, hidden {hidden}, "
            f"{heads} query heads, mlp {intermediate}, {POSITIONS[width]} positions, float32, seed {SEED}{kind}\n")


def make_tiny_model(out_dir: str | Path, width: str = "narrow", attention: str = "full") -> Path:
    """Write the tiny model (``width``: a key of ``WIDTHS``; ``attention``: one of ``ATTENTION``)
    into ``out_dir``; return its path."""
    if width not in WIDTHS:
        raise ValueError(f"unknown tiny-model width {width!r}; expected one of {sorted(WIDTHS)}")
    if attention not in ATTENTION:
        raise ValueError(f"unknown tiny-model attention {attention!r}; expected one of {list(ATTENTION)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, POSITIONS[width])
    _write_model(out, width, attention)
    (out / "KVRELAY_TINY_MODEL").write_text(_marker(width, attention))
    return out


def ensure_tiny_model(out_dir: str | Path, width: str = "narrow", attention: str = "full") -> Path:
    """Create the tiny model unless ``out_dir`` already holds this variant of it."""
    out = Path(out_dir)
    marker = out / "KVRELAY_TINY_MODEL"
    if marker.exists() and marker.read_text() == _marker(width, attention) and (out / "model.safetensors").exists():
        return out
    return make_tiny_model(out, width, attention)
