"""Engine configurations kvrelay serves exactly, and the ones it refuses when a node starts.

A PD pair answers exactly as one vLLM only if the KV it moves means the same on both sides
and nothing the decode node needs stays behind. This module states, for one engine (and for
a prefill/decode pair), what breaks that, as a list of :class:`Refusal` naming the flag and
the reason. It reads the same facts from two places:

* before anything starts (``kvrelay up``, ``kvrelay serve``, ``kvrelay config --check``):
  the engine's argument list and the model's ``config.json`` (:func:`facts_from_args`);
* inside vLLM, when a connector is built (:func:`facts_from_vllm`), so an engine started
  by hand with ``--kv-transfer-config`` is refused the same way, before its first request.

What is refused and why (docs/guide/compatibility.md is generated from
:mod:`kvrelay.deploy.compat`, which cites the tests behind every row):

* speculative decoding: a drafter (EAGLE, MTP, Medusa, a draft model) keeps KV of its own that
  no connector moves; n-gram drafting has none, but on vLLM's CPU build the decode engine's
  rejection sampler failed (an index out of bounds in its top-k/top-p path) on a seeded
  top-k/top-p request whose prompt KV the connector had loaded, which one vLLM with the same
  flags answered; refused until proven;
* a KV cache in another dtype than the model's (``--kv-cache-dtype bfloat16`` under a float32
  model, FP8): measured on vLLM's CPU build, a bfloat16 KV cache under a float32 model changed
  14 of 16 answers although the KV the decode node installed equalled the prefill node's
  byte for byte; refused until a configuration of this kind is proven exact;
* attention that is not a uniform per-token KV cache: MLA latent caches, mamba / linear
  attention state, chunked local attention;
* a prefill and a decode node with different block sizes, or a chunk that is not a whole
  number of blocks;
* a sliding window on every layer (vLLM's sliding-window KV manager): a 300-request sweep with
  the store on found 7 answers whose first token, from the prefill node, differed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_EXACT: frozenset[str] = frozenset()         # none proven yet (n-gram: see the module docstring)
_DTYPE_NAMES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32",
                "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}
SSM_MARKERS = ("mamba", "jamba", "bamba", "zamba", "nemotron_h", "falcon_h1", "granitemoehybrid",
               "qwen3_next", "plamo2", "lfm2", "minimax", "kimi_linear")
SSM_LAYER_KINDS = ("mamba", "linear_attention", "conv", "ssm")


@dataclass(frozen=True)
class Refusal:
    """Why an engine configuration cannot be served exactly: the flag (or model field) and the reason."""

    flag: str
    reason: str

    def __str__(self) -> str:
        return f"{self.flag}: {self.reason}"


@dataclass(frozen=True)
class EngineFacts:
    """What decides exactness, for one engine."""

    block_size: int | None = None                  # None: the platform's default
    kv_cache_dtype: str = "auto"
    model_dtype: str = "auto"                      # the dtype the model runs in ("auto": the checkpoint's)
    calculate_kv_scales: bool = False
    speculative_method: str | None = None
    hf: Mapping[str, Any] = field(default_factory=dict)   # the model's config.json (text part)


def _spec_method(spec: Any) -> str | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return "unparsable"
    if isinstance(spec, Mapping):
        method = spec.get("method") or ("draft_model" if spec.get("model") else None)
        return str(method) if method else "unknown"
    return str(getattr(spec, "method", None) or "unknown")


def _flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--block-size", "--block_size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--calculate-kv-scales", "--calculate_kv_scales", action="store_true")
    p.add_argument("--speculative-config", "--speculative_config", "-sc", default=None)
    return p


def read_hf_config(model: str) -> dict[str, Any]:
    """A local model directory's ``config.json`` (its ``text_config`` merged in); {} otherwise."""
    path = Path(model).expanduser() / "config.json" if model else None
    if path is None or not path.is_file():
        return {}
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {**hf, **hf.get("text_config", {})} if isinstance(hf, dict) else {}


def facts_from_args(args: Sequence[str], hf: Mapping[str, Any] | None = None) -> EngineFacts:
    """Facts from a vLLM argument list (unknown flags are vLLM's business) and a model config."""
    ns, _ = _flags().parse_known_args(list(args))
    hf = dict(hf or {})
    model = ns.dtype if ns.dtype != "auto" else str(hf.get("torch_dtype") or hf.get("dtype") or "auto")
    return EngineFacts(ns.block_size, ns.kv_cache_dtype, model, ns.calculate_kv_scales,
                       _spec_method(ns.speculative_config), hf)


def facts_from_vllm(vllm_config: Any) -> EngineFacts:
    """Facts from a running engine's ``VllmConfig``."""
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    hf_obj = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    to_dict = getattr(hf_obj, "to_dict", None)
    hf = to_dict() if callable(to_dict) else {}
    return EngineFacts(getattr(cc, "block_size", None), str(getattr(cc, "cache_dtype", "auto")),
                       str(getattr(mc, "dtype", "auto")), bool(getattr(cc, "calculate_kv_scales", False)),
                       _spec_method(getattr(vllm_config, "speculative_config", None)), hf)


def _attention_refusals(hf: Mapping[str, Any]) -> list[Refusal]:
    found = []
    model_type = str(hf.get("model_type", "")).lower()
    kinds = [str(k).lower() for k in (hf.get("layer_types") or hf.get("layers_block_type") or [])]
    if hf.get("kv_lora_rank"):
        found.append(Refusal(f"model {model_type or '?'} (kv_lora_rank)",
                             "MLA keeps one latent KV per token; kvrelay has not proven it exact "
                             "(vLLM's NixlConnector supports it only partly)"))
    if any(m in model_type for m in SSM_MARKERS) or any(k.startswith(SSM_LAYER_KINDS) for k in kinds):
        found.append(Refusal(f"model {model_type or '?'} (mamba / linear-attention layers)",
                             "recurrent state is not a per-token KV cache; kvrelay moves KV blocks only"))
    sliding = [k == "sliding_attention" for k in kinds]
    if hf.get("sliding_window") and hf.get("use_sliding_window") is not False and (not kinds or all(sliding)):
        found.append(Refusal(f"model {model_type or '?'} (sliding_window on every layer)",
                             "measured on vLLM's CPU build: with the store on, 7 of 300 answers with token 1 from "
                             "the prefill node differed from one vLLM's; refused until proven"))
    if hf.get("attention_chunk_size"):
        found.append(Refusal(f"model {model_type or '?'} (attention_chunk_size)",
                             "chunked local attention has not been proven exact through kvrelay"))
    return found


def refusals(facts: EngineFacts) -> list[Refusal]:
    """Why one engine configured as ``facts`` cannot be served exactly (empty: it can)."""
    found = _attention_refusals(facts.hf)
    method = facts.speculative_method
    if method is not None and method not in SPEC_EXACT:
        why = ("n-gram drafting killed vLLM's decode engine (its rejection sampler) on a request whose prompt KV "
               "was loaded" if method == "ngram" else "the drafter keeps KV of its own, which no connector transfers")
        found.append(Refusal(f"--speculative-config method {method!r}", f"{why}; serve without speculation"))
    if facts.calculate_kv_scales:
        found.append(Refusal("--calculate-kv-scales", "each engine computes its own FP8 scales at run time, so "
                             "the decode node would read the prefill node's bytes with other scales"))
    kv, model = _DTYPE_NAMES.get(facts.kv_cache_dtype, facts.kv_cache_dtype), _DTYPE_NAMES.get(
        facts.model_dtype, facts.model_dtype)
    if kv != "auto" and kv != model:
        found.append(Refusal(f"--kv-cache-dtype {facts.kv_cache_dtype}", f"a KV cache in another dtype than the "
                             f"model's ({facts.model_dtype}) has not been proven exact through kvrelay: leave "
                             "--kv-cache-dtype at auto"))
    return found


def pair_refusals(prefill: EngineFacts, decode: EngineFacts, chunk_tokens: int,
                  default_block: int | None = None) -> list[Refusal]:
    """Why a prefill and a decode engine cannot exchange chunks (both engines' own refusals too)."""
    found = [*refusals(prefill), *refusals(decode)]          # one engine's refusals once (deduplicated below)
    p_block, d_block = prefill.block_size or default_block, decode.block_size or default_block
    if p_block != d_block:
        found.append(Refusal(f"--block-size {p_block or 'default'} (prefill) vs {d_block or 'default'} (decode)",
                             "a chunk is a run of whole engine blocks, and blocks of another size are other "
                             "bytes: give both roles the same --block-size"))
    for role, block in (("prefill", p_block), ("decode", d_block)):
        if block and chunk_tokens % block:
            found.append(Refusal(f"--block-size {block} ({role})", f"chunk_tokens {chunk_tokens} is not a "
                                 "multiple of it: a chunk must be a whole number of blocks"))
    if prefill.kv_cache_dtype != decode.kv_cache_dtype:
        found.append(Refusal(f"--kv-cache-dtype {prefill.kv_cache_dtype} (prefill) vs {decode.kv_cache_dtype} "
                             "(decode)", "the two roles would store the same KV in other bytes"))
    return list(dict.fromkeys(found))
