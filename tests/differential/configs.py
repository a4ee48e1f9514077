"""The engine configuration as an axis of the differential harness.

For each :class:`EngineCase`: one plain vLLM and one 1P2D kvrelay stack, both started with
the case's engine flags (and the same dtype and one pinned thread per engine), answer the
same seeded requests. The stack is asked through every path a request can take:

* the split path in both ``router.first_token`` modes at once (two routers, 4 in flight each),
  or in the ones a case names (:attr:`EngineCase.modes`);
* decode-first with D alone (the second router serves prompts of up to 256 tokens on D);
* a second round through the stack's router: the prefill node's own prefix cache is off,
  so every repeated prompt is a store hit (and, with LoRA, every prompt asked of another
  model before is a store miss that must stay one);
* a migration: greedy streams, one decode node SIGKILLed mid-stream, each answer equal to
  the uninterrupted one.

With LoRA adapters every drawn request is asked of the base model and of each adapter, one
after another (the last adapter loaded at run time through the router's
``/v1/load_lora_adapter``, the reference given it at start), so the same prompt meets the store under every model. They are asked one at a
time, of the reference and of kvrelay alike: vLLM 0.32's CPU build answers a base-model request
wrongly when it shares a batch with an adapter's (measured: the base model's greedy answer
became an adapter's), so concurrent LoRA traffic has no right answer to compare against there.
The migration's streams all run under one adapter for the same reason. Any difference is one
:class:`~tests.differential.run.Difference`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvrelay.deploy import launch
from kvrelay.deploy.tiny_lora import make_tiny_lora
from kvrelay.deploy.tiny_model import ensure_tiny_model
from tests.differential import run
from tests.differential.compare import Answer
from tests.differential.surface import MODEL, Request, Surface
from tests.e2e.harness import (
    DECODE_FIRST,
    EAGER,
    _cfg,
    busiest_decode,
    read_events,
    retire,
    scrape,
    start_stack,
)

REF_PORT = 18795
STACK_PORT = 24100
LORA_ARGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")   # fewer slots than adapters in use
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2})
MIGRATION_STREAMS, MIGRATION_TOKENS = 6, 120
RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class EngineCase:
    """One engine configuration: flags for every engine (the reference's too) and per role."""

    name: str
    args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()          # besides --no-enable-prefix-caching (store hits)
    decode_args: tuple[str, ...] = ()
    attention: str = "full"                     # the tiny model's attention kind (deploy/tiny_model.py)
    adapters: int = 0                           # LoRA adapters: each request is asked of the base and each
    runtime_adapters: int = 0                   # ... and of these, loaded through the router after start
    eager: bool = True
    max_model_len: int = 4096
    ci: bool = False                            # in the everyday CI run (the rest run with --matrix)
    concurrency: int = 4                        # requests in flight per router (1: one at a time, in turn)
    embeds: int = 0                             # requests sent as prompt embeddings (--enable-prompt-embeds)
    modes: tuple[str, ...] = ("prefill", "decode")   # the router.first_token modes it is served in
    near: bool = False                          # not bitwise on vLLM's CPU build: near-tie flips (measured)
    doc: str = ""


CASES = (
    EngineCase("lora", LORA_ARGS, adapters=1, runtime_adapters=1, ci=True, concurrency=1,
               doc="two LoRA adapters (one loaded at run time) and the base model, interleaved, --max-loras 1"),
    EngineCase("alternating", attention="alternating", ci=True, doc="sliding and full layers in turn"),
    EngineCase("bf16", ("--dtype", "bfloat16"), near=True, doc="a bfloat16 model"),
    EngineCase("fp16", ("--dtype", "float16"), near=True, doc="a float16 model"),
    EngineCase("block64", ("--block-size", "64"), doc="64-token blocks (4 per chunk)"),
    EngineCase("d-no-prefix-cache", decode_args=("--no-enable-prefix-caching",), doc="prefix caching off on D"),
    EngineCase("budget1536", ("--max-num-batched-tokens", "1536"), doc="a 1,536-token chunked-prefill budget"),
    EngineCase("max-num-seqs-1", ("--max-num-seqs", "1"), doc="one request at a time per engine"),
    EngineCase("compiled", eager=False, doc="torch.compile (not --enforce-eager)"),
    EngineCase("prompt-embeds", ("--enable-prompt-embeds",), embeds=8,
               doc="prompt embeddings among the drawn requests (a per-request fallback)"),
    EngineCase("max-len-1024", ("--max-model-len", "1024"), max_model_len=1024,
               doc="--max-model-len 1024, prompts at the limit"),
)
BY_NAME = {c.name: c for c in CASES}


@dataclass
class Outcome:
    case: str
    requests: int
    differences: list[run.Difference] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    store_hits: int = 0
    migrated: float = 0
    wall_s: float = 0.0


def models_of(case: EngineCase) -> list[str]:
    return [MODEL, *(f"adapter{i}" for i in range(1, case.adapters + case.runtime_adapters + 1))]


def adapter_dir(work: Path, i: int) -> Path:
    return make_tiny_lora(work / f"adapter{i}", seed=i)


def engine_args(case: EngineCase, work: Path, with_runtime: bool = False) -> list[str]:
    """The flags every engine of ``case`` gets (adapters written into ``work``; ``with_runtime``:
    the ones the stack loads at run time too, as the reference is given them)."""
    args = [*(EAGER if case.eager else ()), *case.args]
    last = case.adapters + (case.runtime_adapters if with_runtime else 0)
    if last:
        args += ["--lora-modules", *(f"adapter{i}={adapter_dir(work, i)}" for i in range(1, last + 1))]
    return args


def requests_for(case: EngineCase, n: int, seed: int, model_dir: Path) -> list[Request]:
    """``n`` drawn requests, each asked of every model of ``case`` in turn, and its prompt-embedding ones."""
    drawn = Surface(seed, case.max_model_len).draw(n)
    out = []
    for req in drawn:
        for model in models_of(case):
            out.append(Request(len(out), req.path, {**req.body, "model": model}, req.headers))
    return out + embeds_requests(case, model_dir, len(out))


def embeds_requests(case: EngineCase, model_dir: Path, first_index: int) -> list[Request]:
    """Completions whose prompts are the tiny model's own token embeddings ([tokens, hidden], float32)."""
    if not case.embeds:
        return []
    import base64
    import io
    import random

    import torch
    from safetensors.torch import load_file

    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]   # [vocab, hidden]
    out = []
    for i in range(case.embeds):
        rng = random.Random(9000 + i)
        ids = torch.tensor([rng.randint(4, 100) for _ in range(40 + 47 * i)])
        buf = io.BytesIO()
        torch.save(table[ids].clone(), buf)
        body = {"model": MODEL, "prompt_embeds": base64.b64encode(buf.getvalue()).decode(), "max_tokens": 8,
                "temperature": 0, **({"stream": True} if i % 2 else {})}
        out.append(Request(first_index + i, "/v1/completions", body))
    return out


def migration_requests(case: EngineCase, first_index: int) -> list[Request]:
    """Greedy streams long enough to be cut mid-answer, under the last model (an adapter with LoRA)."""
    return [Request(first_index + i, "/v1/completions",
                    {"model": models_of(case)[-1], "prompt": Surface(7000 + i)._text(300 + 41 * i, True),
                     "max_tokens": MIGRATION_TOKENS, "temperature": 0, "ignore_eos": True})
            for i in range(MIGRATION_STREAMS)]


def cfg_for(case: EngineCase, model: Path, work: Path, port: int, **over: Any):
    return _cfg(model, work, port, engine__extra_args=engine_args(case, work, with_runtime=True),
                engine__max_model_len=case.max_model_len, **over)


def run_case(case: EngineCase, n: int, seed: int, work: Path, log: Callable[[str], None] = print) -> Outcome:
    """The whole differential run of one engine configuration (see the module docstring)."""
    t0 = time.monotonic()
    model = ensure_tiny_model(work / f"model-{case.attention}", attention=case.attention)
    reqs = requests_for(case, n, seed, model)
    moving = migration_requests(case, len(reqs))
    ref_cfg = cfg_for(case, model, work / "ref", REF_PORT)
    want = run.reference_answers(ref_cfg, reqs + moving, REF_PORT, work / "ref", concurrency=case.concurrency)
    log(f"[{case.name}] reference: {len(reqs) + len(moving)} requests in {time.monotonic() - t0:.0f} s")
    out = Outcome(case.name, len(reqs))
    before = os.environ.get(RUNTIME_LORA)
    if case.runtime_adapters:                  # vLLM serves /v1/load_lora_adapter only with this set
        os.environ[RUNTIME_LORA] = "True"
    try:
        handle = start_stack(model, work / "stack", STACK_PORT, transport__backend="tcp", deploy__decode=2,
                             store__enabled=True, store__cpu_bytes="1GiB",
                             engine__extra_args=engine_args(case, work / "stack"),
                             engine__max_model_len=case.max_model_len,
                             engine__prefill_args=["--no-enable-prefix-caching", *case.prefill_args],
                             engine__decode_args=list(case.decode_args), router__first_token=case.modes[0],
                             **DECODE_FIRST)
    finally:
        if before is None:
            os.environ.pop(RUNTIME_LORA, None)
        else:
            os.environ[RUNTIME_LORA] = before
    try:
        _load_runtime_adapters(case, handle, work / "stack", log)
        _ask_paths(handle, reqs, want[:len(reqs)], out, log, case)
        out.store_hits = sum(1 for e in read_events(handle.events_path)
                             if e["event"] == "store_load" and e.get("loaded_tokens", 0) > 0)
        out.migrated = _migrate(handle, moving, want[len(reqs):], out)
    finally:
        retire(handle.stack)
    out.wall_s = round(time.monotonic() - t0, 1)
    return out


def _load_runtime_adapters(case: EngineCase, handle: Any, work: Path, log: Callable[[str], None]) -> None:
    """Load the case's run-time adapters through the router: every node must take each one."""
    import urllib.request

    for i in range(case.adapters + 1, case.adapters + case.runtime_adapters + 1):
        body = json.dumps({"lora_name": f"adapter{i}", "lora_path": str(adapter_dir(work, i))}).encode()
        req = urllib.request.Request(f"{handle.router_url}/v1/load_lora_adapter", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:       # an error answer raises HTTPError
            nodes = json.loads(r.read())["nodes"]
        assert len(nodes) == len(handle.stack.specs), f"adapter{i} loaded on {nodes} only"
        log(f"[{case.name}] adapter{i} loaded at run time on {len(nodes)} nodes through the router")


def _ask_paths(handle: Any, reqs: list[Request], want: list[Answer], out: Outcome, log: Callable[[str], None],
               case: EngineCase) -> None:
    """Round 1 through both first_token modes (at once, unless one at a time), then round 2 (store
    hits) through one."""
    from concurrent.futures import ThreadPoolExecutor

    routers, proc = run.routers_of(handle.stack, handle.cfg.router.port + 1, len(case.modes) > 1)
    try:
        concurrency = case.concurrency
        with ThreadPoolExecutor(len(routers) if concurrency > 1 else 1) as pool:
            asked = {mode: pool.submit(run.ask, url, reqs, concurrency, f"round1/{mode}")
                     for mode, url in routers.items()}
            for mode in sorted(asked):
                _note(out, reqs, want, asked[mode].result(), f"{out.case}/{mode}", log)
        # round 2 in reverse: the store's CPU tier is LRU, and a sweep's prompts (times its models) outgrow it;
        # asked in the same order, each would have been evicted just before it came back (0 hits at n=300 LoRA)
        mode = handle.cfg.router.first_token.value
        again = run.ask(routers[mode], reqs[::-1], concurrency, "round2")[::-1]
        _note(out, reqs, want, again, f"{out.case}/{mode}/round2", log)
    finally:
        if proc is not None:
            launch.stop_group(proc)


def _note(out: Outcome, reqs: list[Request], want: list[Answer], have: list[Answer], target: str,
          log: Callable[[str], None]) -> None:
    found = run.compare(reqs, want, have, target)
    out.differences += found
    out.rows.append({"target": target, "requests": len(reqs), "differences": len(found)})
    log(f"[{target}] {len(found)} differences in {len(reqs)} requests")


def _migrate(handle: Any, reqs: list[Request], want: list[Answer], out: Outcome) -> float:
    """Greedy streams; once each has text, SIGKILL the decode node running the most. Returns the
    router's migration count; every stream's text must equal the reference's. In decode mode,
    which does not migrate, a stream the kill cut must end with an error event after an exact
    prefix; the count is then of those."""
    stack, url = handle.stack, handle.router_url
    texts = asyncio.run(_streams(url, reqs, lambda: stack.kill(busiest_decode(stack))))
    told = 0
    for req, ref, got in zip(reqs, want, texts, strict=True):
        ref_text = ref.json()["choices"][0]["text"] if ref.status == 200 else f"HTTP {ref.status}"
        sent, _, error = got.partition("<error ")
        if error and handle.cfg.router.first_token.value == "decode" and ref_text.startswith(sent):
            told += 1                # decode mode does not migrate: an exact prefix, then an error event
        elif got != ref_text:
            out.differences.append(run.Difference(req, f"{out.case}/migration", [f"want {ref_text!r}", f"got {got!r}"]))
    moved = sum(v for k, v in scrape(f"{url}/metrics").items() if k.startswith("kvrelay_router_migrations_total"))
    out.rows.append({"target": f"{out.case}/migration", "requests": len(reqs), "migrated": moved, "told": told,
                     "differences": sum(d.target.endswith("/migration") for d in out.differences)})
    return moved or (told if handle.cfg.router.first_token.value == "decode" else 0)


async def _streams(url: str, reqs: list[Request], kill: Callable[[], None]) -> list[str]:
    texts = [""] * len(reqs)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        async with session.post(f"{url}{reqs[i].path}", json={**reqs[i].body, "stream": True}) as r:
            pending = b""
            async for piece in r.content.iter_any():
                *events, pending = (pending + piece).split(b"\n\n")
                for raw in events:
                    data = raw.strip().removeprefix(b"data: ")
                    if data and data != b"[DONE]":
                        ev = json.loads(data)
                        texts[i] += "".join(c.get("text", "") for c in ev.get("choices", ())) or (
                            f"<error {ev['error']['message']}>" if "error" in ev else "")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(len(reqs))]
        while not all(len(t) >= 5 for t in texts):
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
    return texts

