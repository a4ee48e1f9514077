"""The compatibility matrix: which engine configurations kvrelay serves exactly, which it
serves by letting the engine compute (a per-request fallback), and which it refuses at start.

Every row names the tests that prove it; ``tests/deploy/test_compat.py`` checks that each
named test exists and that ``docs/guide/compatibility.md`` is this module's output
(``kvrelay compat --markdown docs/guide/compatibility.md`` writes it). The refusals
themselves are :mod:`kvrelay.core.engine_compat`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path


class Support(str, enum.Enum):
    EXACT = "exact"          # every path (split, decode-first, store, migration) answers as one vLLM
    FALLBACK = "fallback"    # such a request is computed by its engine; the answer is exact
    NEAR = "served, not bitwise"   # answers may differ from one vLLM's at near-ties (measured)
    REFUSED = "refused"      # refused when a node starts, naming the flag (config --check too)


class Proof(str, enum.Enum):
    CI = "CI"                # runs in every CI run
    MATRIX = "--matrix"      # runs with pytest --matrix (the rest of a matrix)
    UNIT = "unit"            # unit-tested here (vLLM's CPU build cannot run it)


ENGINE = "tests/differential/test_engine_configs.py"
CFG = f"{ENGINE}::test_an_engine_configuration_answers_as_one_vllm_with_its_flags"
REFUSE = "tests/core/test_engine_compat.py"


@dataclass(frozen=True)
class Row:
    feature: str
    setting: str
    support: Support
    proof: Proof
    why: str
    tests: tuple[str, ...]
    nixl: str = ""           # what vLLM's NixlConnector documents for the same feature


ROWS = (
    Row("LoRA adapters", "--enable-lora --lora-modules A=.. B=.. --max-loras 1", Support.EXACT, Proof.CI,
        "every key names the adapter (its name and a digest of its files): chunk, store and transfer keys, "
        "and the router's KV index; a store never serves one adapter's KV to another or to the base model",
        (f"{CFG}[lora]", "tests/core/test_kv_namespace.py", "tests/router/test_kv_index.py::"
         "test_an_adapters_blocks_are_held_for_that_adapter_only", "tests/core/test_connector_state.py::"
         "test_an_adapters_requests_carry_its_namespace_into_every_key_the_workers_compute")),
    Row("KV-cache dtype other than the model's", "--kv-cache-dtype bfloat16 under float32, fp8, ...",
        Support.REFUSED, Proof.CI, "measured on vLLM's CPU build: a bfloat16 KV cache under a float32 model changed "
        "14 of 16 answers although D installed P's KV byte for byte; refused until proven (the GPU check is where "
        "FP8 can be)", (REFUSE, f"{ENGINE}::test_a_refused_configuration_fails_when_vllm_starts_not_at_a_request"),
        "FP8 with static scales only"),
    Row("FP8 scales computed at run time", "--calculate-kv-scales", Support.REFUSED, Proof.UNIT,
        "each engine computes its own scales, so D would read P's bytes with other scales", (REFUSE,)),
    Row("Model dtype", "--dtype bfloat16 | float16 (KV cache auto)", Support.NEAR, Proof.MATRIX,
        "a prompt's first pass is one vLLM's to the bit (greedy logprobs equal in 13 of 13, every token from D); "
        "a repeat (a store hit, D's prefix cache, token 1 from P) is computed in another shape and differs in "
        "single rounding steps, as one vLLM asked the same prompt again does: one vLLM against itself 8 of 13 "
        "bitwise and 1 answer changed, kvrelay's store round against one vLLM's first answers 6 of 13 and the "
        "same answer changed at the same token, against one vLLM asked again 8 of 13 and none changed. Measured "
        "on vLLM's CPU build, bfloat16 (python -m tests.differential.logprob_paths; docs/lab/half-precision.md)",
        (f"{CFG}[bf16]", f"{CFG}[fp16]")),
    Row("Speculative decoding, n-gram", "--speculative-config '{\"method\": \"ngram\", ...}'", Support.REFUSED,
        Proof.CI, "measured on vLLM's CPU build: the decode engine's rejection sampler failed on a seeded top-k "
        "request whose prompt KV the connector had loaded (one vLLM with the same flags answered it)",
        (REFUSE, f"{ENGINE}::test_a_refused_configuration_fails_when_vllm_starts_not_at_a_request")),
    Row("Speculative decoding with a drafter", "method eagle | eagle3 | mtp | medusa | draft_model",
        Support.REFUSED, Proof.UNIT, "the drafter keeps KV of its own, which no connector transfers", (REFUSE,)),
    Row("Block size", "--block-size 64 on both roles", Support.EXACT, Proof.MATRIX,
        "a chunk is a whole number of blocks (here 4)", (f"{CFG}[block64]",)),
    Row("Block size, P and D differ", "--block-size in engine.prefill_args only", Support.REFUSED, Proof.UNIT,
        "blocks of another size are other bytes; a chunk must also be a whole number of blocks", (REFUSE,),
        "block sizes only P < D"),
    Row("Sliding-window attention", "every layer a sliding window (Mistral-style)", Support.REFUSED, Proof.CI,
        "measured: 0 differences in 16 requests, but a 300-request sweep with the store on found 7 answers whose "
        "first token, from the prefill node, differed from one vLLM's", (REFUSE,
        f"{ENGINE}::test_a_refused_configuration_fails_when_vllm_starts_not_at_a_request")),
    Row("Per-layer mixed attention", "sliding and full layers in turn (Gemma-2/3-style)", Support.EXACT,
        Proof.CI, "vLLM turns its hybrid KV-cache manager off for a connector without HMA support, so "
                      "every layer has a full KV cache; an engine with several KV-cache groups is refused",
        (f"{CFG}[alternating]", REFUSE)),
    Row("MLA", "DeepSeek-V2/V3-style latent KV (kv_lora_rank)", Support.REFUSED, Proof.UNIT,
        "not proven exact through kvrelay (vLLM's CPU build does not run it)", (REFUSE,), "partial (replicated KV)"),
    Row("Mamba / linear-attention hybrids", "Jamba, Bamba, Nemotron-H, Qwen3-Next, ...", Support.REFUSED,
        Proof.UNIT, "recurrent state is not a per-token KV cache", (REFUSE,), "equal TP only"),
    Row("Chunked local attention", "attention_chunk_size (Llama 4)", Support.REFUSED, Proof.UNIT,
        "not proven exact through kvrelay", (REFUSE,)),
    Row("Tensor parallelism, equal", "engine.prefill_tp = engine.decode_tp", Support.EXACT, Proof.CI,
        "rank r feeds rank r", ("tests/e2e/test_tp.py",)),
    Row("Tensor parallelism, mixed", "engine.prefill_tp != engine.decode_tp", Support.EXACT, Proof.CI,
        "heads re-sharded per chunk, in head-major (HND: the CPU layout) and token-major (NHD: FlashAttention, "
        "FlashInfer) blocks; a layout with no heads dimension in its blocks is refused at start",
        ("tests/e2e/test_tp.py", "tests/core/test_ranks.py", "tests/core/test_mixed_tp_layouts.py"),
        "heterogeneous TP on HND only"),
    Row("Pipeline or data parallelism in a node", "--pipeline-parallel-size, --data-parallel-size",
        Support.REFUSED, Proof.UNIT, "scale with more prefill and decode nodes instead",
        ("tests/deploy/test_tp_config.py",)),
    Row("Prefix caching off on D", "engine.decode_args: --no-enable-prefix-caching", Support.EXACT,
        Proof.MATRIX, "D installs every pushed chunk", (f"{CFG}[d-no-prefix-cache]",)),
    Row("Chunked-prefill budget", "--max-num-batched-tokens 1536", Support.EXACT, Proof.MATRIX,
        "chunks are pushed as each step completes them", (f"{CFG}[budget1536]",)),
    Row("One request at a time", "--max-num-seqs 1", Support.EXACT, Proof.MATRIX, "",
        (f"{CFG}[max-num-seqs-1]",)),
    Row("Compiled engines", "no --enforce-eager (torch.compile)", Support.EXACT, Proof.MATRIX, "",
        (f"{CFG}[compiled]", "tests/e2e/test_compiled.py")),
    Row("Context at the limit", "--max-model-len 1024, prompts at the limit", Support.EXACT, Proof.MATRIX,
        "", (f"{CFG}[max-len-1024]",)),
    Row("Images, audio, video", "multimodal prompts", Support.FALLBACK, Proof.UNIT,
        "placeholder token ids do not name the content: the engine computes the prompt",
        ("tests/core/test_connector_state.py::test_multimodal_requests_bypass_the_push_the_pull_and_the_store",
         "tests/core/test_kv_namespace.py::test_images_and_prompt_embeddings_make_a_prompt_opaque")),
    Row("Prompt embeddings", "--enable-prompt-embeds, prompt_embeds", Support.FALLBACK, Proof.MATRIX,
        "embeddings are not token ids: the engine computes the prompt",
        (f"{CFG}[prompt-embeds]", "tests/core/test_kv_namespace.py::test_images_and_prompt_embeddings_make_a_prompt_opaque")),
    Row("Structured outputs, tools, logprobs, n > 1", "response_format, tools, logprobs, n", Support.FALLBACK,
        Proof.CI, "the router does not split them: D computes token 1 itself, from pushed KV",
        ("tests/differential/test_differential.py",)),
)


def markdown() -> str:
    """The matrix as the Markdown page ``docs/guide/compatibility.md``."""
    head = ["# Compatibility", "",
            "Which engine configurations kvrelay serves exactly (the same answers as one vLLM with the same "
            "flags, through the split path in both `router.first_token` modes, decode-first with D alone, a "
            "store hit and a migration), which requests it leaves to the engine (`fallback`: still exact), and "
            "which configurations it refuses when a node starts (`refused`: `kvrelay up`, `kvrelay serve` and "
            "`kvrelay config --check` name the flag and the reason; an engine started by hand with "
            "`--kv-transfer-config` fails the same way before its first request).", "",
            "*Proven by*: `CI` runs in every CI run; `--matrix` runs with `pytest --matrix`; `unit` is a unit test "
            "(vLLM's CPU build cannot run the feature). The last column is what vLLM's own NixlConnector documents "
            "for the same feature. Generated by `kvrelay compat`; a test keeps it current.", "",
            "| feature | setting | kvrelay | proven by | why | NixlConnector | tests |",
            "|---|---|---|---|---|---|---|"]
    rows = [f"| {r.feature} | `{r.setting}` | **{r.support.value}** | {r.proof.value} | {r.why or '-'} | "
            f"{r.nixl or '-'} | {'<br>'.join(f'`{t}`' for t in r.tests)} |" for r in ROWS]
    return "\n".join(head + rows) + "\n"


def write_markdown(path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown())
    return out
