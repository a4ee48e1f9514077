"""How exact one plain vLLM is with itself: the same requests at concurrency 1, then 4, then 1 again.

The differential harness asks kvrelay for answers identical to one vLLM's. That bar is only
meaningful where one vLLM agrees with itself when nothing but the batch around a request
changes: a prefill node computes a prompt in other batches than the reference does, and a
decode node decodes it beside other requests. This runs one server with a configuration's
engine flags (the reference's: same dtype, same thread binding), asks it the drawn requests
one at a time (A), four at a time (B) and one at a time again (C), and compares them as the
harness compares kvrelay with the reference: A against C says whether the server is
deterministic at all, A against B how much its batching alone changes.

    python -m tests.differential.self_compare --config bf16 --n 40 --json docs/results/self-compare-bf16.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvrelay.deploy import launch
from kvrelay.deploy.tiny_model import ensure_tiny_model
from tests.differential import run
from tests.differential.configs import CASES, EngineCase, cfg_for, requests_for
from tests.differential.surface import MODEL

PORT = 27900


def self_compare(case: EngineCase, n: int, seed: int, work: Path) -> dict:
    model = ensure_tiny_model(work / f"model-{case.attention}", attention=case.attention)
    reqs = [r for r in requests_for(case, n, seed, model) if "seed" not in r.body]   # seeded ones run alone anyway
    cfg = cfg_for(case, model, work / "ref", PORT)
    spec = launch.NodeSpec(launch.Role.SINGLE, 0, PORT)
    (work / "ref").mkdir(parents=True, exist_ok=True)
    with open(work / "ref" / "server.log", "w") as log:
        proc = launch.spawn_group(launch.server_command(cfg, spec), launch.server_env(cfg, 0, 2), log)
    t0 = time.monotonic()
    try:
        url = f"http://127.0.0.1:{PORT}"
        launch.wait_healthy(url, proc, 900, str(work / "ref" / "server.log"))
        a = run.ask(url, reqs, 1, "concurrency 1")
        b = run.ask(url, reqs, 4, "concurrency 4")
        c = run.ask(url, reqs, 1, "concurrency 1 again")
    finally:
        launch.stop_group(proc)
    same = run.compare(reqs, a, c, "c1 again")
    batched = run.compare(reqs, a, b, "c4")
    return {"config": case.name, "args": list(case.args), "requests": len(reqs),
            "c1_vs_c1_again": len(same), "c1_vs_c4": len(batched), "wall_s": round(time.monotonic() - t0, 1),
            "examples": [d.lines[:3] for d in batched[:3]]}


def tail_compare(case: EngineCase, n: int, seed: int, work: Path) -> dict:
    """One vLLM, each prompt twice: fresh, then with every full block in its prefix cache, so only
    its last token is computed (prompt lengths of 128k + 1: a whole number of 16- and 128-token
    blocks, plus one). What a decode node does with a pushed prompt, inside one vLLM."""
    import random

    import aiohttp

    model = ensure_tiny_model(work / f"model-{case.attention}", attention=case.attention)
    cfg = cfg_for(case, model, work / "tail", PORT)
    (work / "tail").mkdir(parents=True, exist_ok=True)
    with open(work / "tail" / "server.log", "w") as log:
        proc = launch.spawn_group(launch.server_command(cfg, launch.NodeSpec(launch.Role.SINGLE, 0, PORT)),
                                  launch.server_env(cfg, 0, 2), log)
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 100) for _ in range(128 * rng.randrange(1, 8) + 1)] for _ in range(n)]

    async def hits(url: str) -> float:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    async def answers(url: str) -> list[list[int]]:
        out = []
        async with aiohttp.ClientSession() as s:
            for ids in prompts:
                body = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "logprobs": 1}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    out.append((await r.json())["choices"][0]["logprobs"]["tokens"])
        return out

    t0 = time.monotonic()
    try:
        url = f"http://127.0.0.1:{PORT}"
        launch.wait_healthy(url, proc, 900, str(work / "tail" / "server.log"))
        fresh = asyncio.run(answers(url))
        before = asyncio.run(hits(url))
        cached = asyncio.run(answers(url))
        hit = asyncio.run(hits(url)) - before
    finally:
        launch.stop_group(proc)
    differ = [i for i, (a, b) in enumerate(zip(fresh, cached, strict=True)) if a != b]
    return {"config": case.name, "prompts": n, "fresh_vs_last_token_alone": len(differ),
            "prefix_cache_hit_tokens": hit, "prompt_tokens": sum(map(len, prompts)),
            "wall_s": round(time.monotonic() - t0, 1)}


def chunk_compare(case: EngineCase, n: int, seed: int, work: Path) -> dict:
    """One vLLM, each prompt (256 m + r tokens, 0 < r < 256) twice from an empty prefix cache:
    whole, then after its first 256 m tokens alone, so that only the last r are computed beside
    a cached prefix: what a decode node does with the whole chunks a prefill node pushed."""
    import random

    import aiohttp

    model = ensure_tiny_model(work / f"model-{case.attention}", attention=case.attention)
    cfg = cfg_for(case, model, work / "chunk", PORT)
    (work / "chunk").mkdir(parents=True, exist_ok=True)
    env = {**launch.server_env(cfg, 0, 2), "VLLM_SERVER_DEV_MODE": "1"}      # POST /reset_prefix_cache
    with open(work / "chunk" / "server.log", "w") as log:
        proc = launch.spawn_group(launch.server_command(cfg, launch.NodeSpec(launch.Role.SINGLE, 0, PORT)), env, log)
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 100) for _ in range(256 * rng.randrange(1, 6) + rng.randrange(1, 256))]
               for _ in range(n)]

    async def ask(s: aiohttp.ClientSession, url: str, ids: list[int], tokens: int) -> list[str]:
        body = {"model": MODEL, "prompt": ids, "max_tokens": tokens, "temperature": 0, "logprobs": 1}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            return (await r.json())["choices"][0]["logprobs"]["tokens"]

    async def both(url: str) -> tuple[list, list]:
        whole, split = [], []
        async with aiohttp.ClientSession() as s:
            for ids in prompts:
                async with s.post(f"{url}/reset_prefix_cache") as r:
                    assert (await r.json())["success"]
                whole.append(await ask(s, url, ids, 24))
                async with s.post(f"{url}/reset_prefix_cache") as r:
                    assert (await r.json())["success"]
                await ask(s, url, ids[:len(ids) // 256 * 256], 1)
                split.append(await ask(s, url, ids, 24))
        return whole, split

    t0 = time.monotonic()
    try:
        url = f"http://127.0.0.1:{PORT}"
        launch.wait_healthy(url, proc, 900, str(work / "chunk" / "server.log"))
        whole, split = asyncio.run(both(url))
    finally:
        launch.stop_group(proc)
    differ = [i for i, (a, b) in enumerate(zip(whole, split, strict=True)) if a != b]
    return {"config": case.name, "prompts": n, "whole_vs_after_cached_chunks": len(differ),
            "first_differing_token": [next(k for k, (x, y) in enumerate(zip(whole[i], split[i], strict=False)) if x != y)
                                      for i in differ],
            "wall_s": round(time.monotonic() - t0, 1)}


MODES: dict[str, tuple[Callable[[EngineCase, int, int, Path], dict], Callable[[dict], str]]] = {
    "batch": (self_compare, lambda r: f"{r['requests']} requests: {r['c1_vs_c1_again']} differ between two passes at "
              f"concurrency 1, {r['c1_vs_c4']} between concurrency 1 and 4"),
    "tail": (tail_compare, lambda r: f"{r['prompts']} prompts: {r['fresh_vs_last_token_alone']} answers differ when "
             f"only the last token is computed; {r['prefix_cache_hit_tokens']:.0f} of {r['prompt_tokens']} prompt "
             "tokens hit the prefix cache"),
    "chunks": (chunk_compare, lambda r: f"{r['prompts']} prompts: {r['whole_vs_after_cached_chunks']} answers differ "
               f"when the prompt's whole chunks are cached (first differing token: {r['first_differing_token']})"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--config", required=True, help="comma-separated configuration names (tests/differential/configs.py; float32: the default)")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--tail", action="store_true", help="instead: each prompt fresh, then with only its last token "
                    "computed (its prefix cached)")
    ap.add_argument("--chunks", action="store_true", help="instead: each prompt whole, then with its whole "
                    "256-token chunks cached (what a decode node computes)")
    args = ap.parse_args(argv)
    by_name = {c.name: c for c in CASES} | {"float32": EngineCase("float32", doc="the default float32 model")}
    run, say = MODES["chunks" if args.chunks else "tail" if args.tail else "batch"]
    results = []
    for name in args.config.split(","):
        with tempfile.TemporaryDirectory(prefix="kvrelay-self-") as tmp:
            res = run(by_name[name], args.n, args.seed, Path(tmp))
        print(f"[{name}] {say(res)} ({res['wall_s']} s)", flush=True)
        results.append(res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
