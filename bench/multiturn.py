"""`kvrelay bench multiturn`: multi-turn chat TTFT with the prefill store on and off.

A synthetic workload generated locally (no dataset): ``--users`` conversations of
``--turns`` turns share one system prompt; every turn appends a new user message to the
growing history (and the model's previous answer). Both runs use the same 1P1D stack
shape (the store-on stack first, then the store-off one, on disjoint ports) with vLLM's
own prefix cache **off on the prefill node**, so the only reuse is kvrelay's store (what
a node sees when the engine cache is too small or the previous turn ran elsewhere).
Reported per turn: median TTFT with the store on / off and their ratio, the store hit
rate (tokens loaded / prompt tokens) and chunks and MiB loaded per tier; plus the store-path
overhead: the median ratio of paired prefills of the same fresh prompt (nothing to
reuse) on the store-on and store-off prefill nodes. JSON + PNG under ``--out``.

``--realistic`` runs the case users run instead: vLLM's prefix cache **on** for every
engine, each engine's KV cache capped at ``--kv-blocks`` blocks so that ``--users``
histories do not fit (``--decode-kv-blocks`` sizes the decode node's apart), and **two
prefill nodes** (2P1D). It compares, on the same
conversations, "prefix cache only" (store off, round-robin routing, so a turn often lands
on the other node) against "store + cache-aware routing" (store on, ``router.policy:
cache_aware``). Users are served in interleaved order, one turn each per round.
``--decode-first`` compares the same baseline against decode-first routing on the engines'
own KV events (store off): each turn's decision (D alone, or which P pushed to which D) is
printed and kept in the JSON, and the turns with at least ``--long-history`` tokens are
pooled into one mean TTFT per system.

The model defaults to the tiny model's ``wide`` variant (``--model wide``): the same KV
layout, so every chunk is the same 2 MiB, but linear layers dominate its compute as in
real models. ``--model narrow`` is the 3 M-parameter default model, whose compute is
mostly attention; ``--model PATH`` runs any local checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.bench import stack_flags
from kvrelay.bench.e2e import ALPHABET, _post
from kvrelay.bench.local_redis import REDIS, redis_server
from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg
from kvrelay.core.engine_compat import read_hf_config
from kvrelay.core.telemetry import read_events
from kvrelay.deploy import launch
from kvrelay.deploy.tiny_model import WIDTHS, ensure_tiny_model


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=int, default=2, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--system-tokens", type=int, default=1024,
                   help="system prompt tokens, shared by every conversation")
    p.add_argument("--user-tokens", type=int, default=512, help="tokens of each user turn")
    p.add_argument("--answer-tokens", type=int, default=64, help="tokens of each answer")
    p.add_argument("--fresh-prompts", type=int, default=8,
                   help="store-overhead probe: fresh 2048-token prompts, each sent to both prefill nodes")
    p.add_argument("--model", default="wide",
                   help="'wide' (default) or 'narrow' tiny-model variant, or a local model path")
    p.add_argument("--save-decoded", action="store_true",
                   help="store-on stack: also save the decode node's answer chunks (store.save_decoded) into a "
                        "redis-server the benchmark starts")
    p.add_argument("--realistic", action="store_true",
                   help="prefix caches on, engines' KV capped (--kv-blocks), 2 prefill nodes; prefix cache + "
                        "round-robin vs store + cache-aware routing")
    p.add_argument("--decode-first", action="store_true",
                   help="--realistic: compare prefix cache + round-robin against decode-first routing on the "
                        "engines' KV events (router.decode_first; store off) instead of store + cache-aware")
    p.add_argument("--disagg-min-tokens", type=int, default=-1,
                   help="--decode-first: router.disagg_min_tokens and disagg_min_tokens_idle (-1 = the "
                        "configured defaults)")
    p.add_argument("--kv-blocks", type=int, default=72,
                   help="--realistic: each engine's KV cache in blocks (vLLM's --num-gpu-blocks-override; 72 x 128 tokens: one 8192-token prompt and a little)")
    p.add_argument("--decode-kv-blocks", type=int, default=0,
                   help="--realistic: the decode node's KV cache in blocks, in both systems (0 = --kv-blocks). "
                        "Decode nodes hold every running conversation, so deployments give them the larger cache")
    p.add_argument("--long-history", type=int, default=4096,
                   help="the summary pools every request with at least this many prompt tokens")
    p.add_argument("--base-port", type=int, default=19300,
                   help="first port: the store-on stack uses the ports from here, the store-off one from here + 200")
    p.add_argument("--out", default="bench_results", help="directory for the JSON, table and PNG")
    stack_flags.add_args(p)


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _chat(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int, str, str]:
    """Streamed chat turn: (TTFT seconds, answer, prompt tokens, the prefill node that served it ("" = none),
    the decode node)."""
    import urllib.request

    body = {"model": launch.TINY_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, parts, prompt_tokens = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        node, d_node = r.headers.get("X-Kvrelay-Prefill", ""), r.headers.get("X-Kvrelay-Decode", "")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                prompt_tokens = ev["usage"]["prompt_tokens"]
            for ch in ev.get("choices", []):
                text = ch.get("delta", {}).get("content") or ""
                if text and first is None:
                    first = time.perf_counter()
                parts.append(text)
    return (first or time.perf_counter()) - t0, "".join(parts), prompt_tokens, node, d_node


def _stack(args: argparse.Namespace, out: Path, store: bool, redis_url: str = "") -> tuple[launch.Stack, Path]:
    """A stack (not started) with the store on or off; the two use disjoint ports.

    Default: 1P1D, the prefill node's prefix cache off. ``--realistic``: 2P1D, every
    engine's prefix cache on and its KV capped; the store-off stack routes round-robin,
    the store-on stack cache-aware.
    """
    sub = out / ("store-on" if store else "store-off")
    sub.mkdir(parents=True, exist_ok=True)
    base = args.base_port + (0 if store else 200)
    engine: dict[str, Any] = {"model": args.model_path, "max_model_len": args.context, "served_model_name": launch.TINY_NAME,
                              "prefill_args": ["--no-enable-prefix-caching"]}
    data: dict[str, Any] = {
        "engine": engine, "deploy": {"base_port": base, "kv_base_port": base + 500, "log_dir": str(sub / "logs")},
        "router": {"port": base + 50, "expose_nodes": True,    # the bench reads X-Kvrelay-Prefill
                   "decode_first": False},                      # the compared systems name their routing
        "connector": {"events_path": str(sub / "events.jsonl")},
        "store": {"enabled": store, "cpu_bytes": "1GiB", "disk_path": str(sub / "disk"), "disk_bytes": "2GiB"},
        "transport": {"backend": "tcp"}}
    if args.realistic:
        engine.update(prefill_args=["--num-gpu-blocks-override", str(args.kv_blocks)],
                      decode_args=["--num-gpu-blocks-override", str(args.decode_kv_blocks or args.kv_blocks)])
        data["deploy"]["prefill"] = 2
        data["router"]["policy"] = "cache_aware" if store else "round_robin"
        if store and args.decode_first:      # the compared system: decode-first on the engines' own events
            data["store"]["enabled"] = False
            data["router"].update(policy="round_robin", decode_first=True)
            if args.disagg_min_tokens >= 0:
                data["router"].update(disagg_min_tokens=args.disagg_min_tokens,
                                      disagg_min_tokens_idle=args.disagg_min_tokens)
    if redis_url:
        data["store"].update(redis_url=redis_url, save_decoded=True)
    return launch.Stack(stack_flags.build(args, data)), sub


def _turns(args: argparse.Namespace, stack: launch.Stack, label: str) -> dict[str, Any]:
    """Every user's turns through the router: TTFT and prompt tokens per turn."""
    url = f"http://127.0.0.1:{stack.cfg.router.port}"
    system = {"role": "system", "content": _text(args.system_tokens, 1)}
    ttft: dict[int, list[float]] = {}
    history_tokens: dict[int, list[int]] = {}
    convs = [[system] for _ in range(args.users)]
    order, rng = list(range(args.users)), random.Random(17)
    last_node: dict[int, str] = {}
    moved = 0
    decisions: list[dict[str, Any]] = []
    for turn in range(args.turns):
        if args.realistic:
            rng.shuffle(order)
        for u in order:
            msgs = convs[u]
            msgs.append({"role": "user", "content": _text(args.user_tokens, 1000 * u + turn + 7)})
            t, answer, n, node, d_node = _chat(url, msgs, args.answer_tokens)
            msgs.append({"role": "assistant", "content": answer})
            ttft.setdefault(turn, []).append(t)
            history_tokens.setdefault(turn, []).append(n)
            moved += u in last_node and last_node[u] != node
            last_node[u] = node
            path = f"P {node} + push to D {d_node}" if node else f"D {d_node} alone"
            print(f"  {label} turn {turn} user {u}: {n} tokens, TTFT {1e3 * t:.0f} ms; {path}", file=sys.stderr)
            decisions.append({"turn": turn, "user": u, "prompt_tokens": n, "ttft_ms": 1e3 * t, "prefill": node,
                              "decode": d_node})
    return {"ttft": ttft, "history_tokens": history_tokens, "moved_turns": moved,
            "later_turns": args.users * (args.turns - 1), "decisions": decisions}


def _prefill_s(p_url: str, prompt: str) -> float:
    t0 = time.perf_counter()
    _post(f"{p_url}/v1/completions", {"model": launch.TINY_NAME, "prompt": prompt, "max_tokens": 1,
                                      "temperature": 0})
    return time.perf_counter() - t0


def _overhead(args: argparse.Namespace, on: launch.Stack, off: launch.Stack) -> list[dict[str, float]]:
    """Store-path overhead, paired: the same fresh prompt on both prefill nodes, back to back.

    Both stacks are up; pairs alternate which node goes first, so drift in the host's
    load cancels instead of landing on one side. Nothing is reusable (every prompt is
    new) and, on the store-on node, every chunk is stored.
    """
    urls = {"on": on.url(on.specs[0]), "off": off.url(off.specs[0])}
    for url in urls.values():               # one unrecorded 2048-token prefill each: warm both paths
        _prefill_s(url, _text(2048, 4999))
    pairs = []
    for i in range(args.fresh_prompts):
        prompt = _text(2048, 5000 + i)
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        t = {side: _prefill_s(urls[side], prompt) for side in order}
        pairs.append(t | {"ratio": t["on"] / t["off"]})
        print(f"  fresh prompt {i}: on {1e3 * t['on']:.0f} ms, off {1e3 * t['off']:.0f} ms", file=sys.stderr)
    return pairs


def _run_all(args: argparse.Namespace, out: Path) -> tuple[dict, dict, list[dict[str, float]]]:
    with contextlib.ExitStack() as ctx:
        url = ""
        if args.save_decoded:
            if REDIS is None:
                raise SystemExit("--save-decoded needs redis-server (deploy/setup.sh installs it)")
            (out / "redis").mkdir(exist_ok=True)
            url, _ = ctx.enter_context(redis_server(out / "redis"))
        return _run_stacks(args, out, url)


def _run_stacks(args: argparse.Namespace, out: Path, redis_url: str) -> tuple[dict, dict, list[dict[str, float]]]:
    (on_stack, on_dir), (off_stack, _) = _stack(args, out, True, redis_url), _stack(args, out, False)
    pairs: list[dict[str, float]] = []
    try:
        if args.realistic:           # one stack at a time: six engines would not share two cores fairly
            off_stack.start(progress=False)
            off = _turns(args, off_stack, "prefix-cache+rr")
            off_stack.stop()
            on_stack.start(progress=False)
            on = _turns(args, on_stack, "decode-first" if args.decode_first else "store+cache-aware")
        else:
            on_stack.start(progress=False)
            on = _turns(args, on_stack, "on ")
            off_stack.start(progress=False)
            off = _turns(args, off_stack, "off")
            pairs = _overhead(args, on_stack, off_stack)
    finally:
        off_stack.stop()
        on_stack.stop()
    on["store"] = _store_stats(on_dir / "events.jsonl")
    return on, off, pairs


def _long_turns(run: dict[str, Any], tokens: int) -> list[float]:
    """Every request's TTFT whose prompt had at least ``tokens`` tokens (all users pooled)."""
    return [t for turn, ts in run["ttft"].items() for t, n in zip(ts, run["history_tokens"][turn], strict=True)
            if n >= tokens]


def _store_stats(path: Path) -> dict[str, Any]:
    evs = read_events(path)
    loads = [e for e in evs if e["event"] == "store_load"]
    prompt = sum(e["prompt_tokens"] for e in evs if e["event"] == "load_done")
    tiers = loads[-1]["tiers"] if loads else {}
    tier_mib = {k: round(v / 2**20, 1) for k, v in (loads[-1].get("tier_bytes", {}) if loads else {}).items()}
    saved = sum(e["written"] for e in evs if e["event"] == "decode_save")
    return {"loaded_tokens": sum(e["loaded_tokens"] for e in loads), "prompt_tokens": prompt,
            "chunks_loaded_per_tier": tiers, "mib_loaded_per_tier": tier_mib, "decode_saved_chunks": saved}


def _model_path(model: str) -> str:
    """``wide`` / ``narrow``: the tiny model variant (created once under ~/.cache); else a path."""
    if model not in WIDTHS:
        return model
    root = Path(kcfg.from_dict({}).engine.tiny_model_dir).expanduser()
    return str(ensure_tiny_model(root if model == "narrow" else root.with_name(root.name + "-" + model), model))


def _summary(args: argparse.Namespace, names: tuple[str, str], on: dict, off: dict, pairs: list,
             lines: list[str]) -> tuple[float, float]:
    """The lines under the per-turn table; returns (store hit rate, store-path overhead)."""
    long_off, long_on = _long_turns(off, args.long_history), _long_turns(on, args.long_history)
    if long_off and long_on:
        a, b = statistics.mean(long_off), statistics.mean(long_on)
        lines.append(f"turns with >= {args.long_history} tokens of history ({len(long_on)} requests each): mean TTFT "
                     f"{names[0]} {1e3 * a:.0f} ms, {names[1]} {1e3 * b:.0f} ms: {a / b:.2f}x")
    st = on["store"]
    hit = st["loaded_tokens"] / max(st["prompt_tokens"], 1)
    over = statistics.median(p["ratio"] for p in pairs) - 1 if pairs else float("nan")
    lines.append(f"store hit rate (tokens loaded / prompt tokens): {hit:.2f}; chunks loaded per tier: "
                 f"{st['chunks_loaded_per_tier']} ({st['mib_loaded_per_tier']} MiB); "
                 f"answer chunks saved by the decode node: {st['decode_saved_chunks']}")
    if args.realistic:
        lines.append("turns served by another prefill node than the user's previous turn: "
                     + ", ".join(f"{name} {x['moved_turns']}/{x['later_turns']}" for name, x in zip(names, (off, on), strict=True)))
    if args.realistic and args.decode_first:
        later = [d for d in on["decisions"] if d["turn"] > 0]
        alone = sum(not d["prefill"] for d in later)
        lines.append(f"decode-first: {alone} of {len(later)} later turns served by their decode node alone "
                     f"(the rest: a prefill node and a push); every turn's decision is in multiturn.json")
    if pairs:
        lines.append(f"store-path overhead on fresh 2048-token prefills (median of {len(pairs)} paired ratios): "
                     f"{100 * over:+.1f}% (target <= +5%)")
    return hit, over


CONTEXT_CAP = 8192        # engines serve at most this (their KV caches are sized for it: --kv-blocks)


def _context(model_path: str) -> int:
    """The context the engines serve: the model's own (its ``max_position_embeddings``), at most
    :data:`CONTEXT_CAP`; the cap where the model names none."""
    own = read_hf_config(model_path).get("max_position_embeddings")
    return min(int(own), CONTEXT_CAP) if isinstance(own, int) else CONTEXT_CAP


def longest_history(args: argparse.Namespace) -> int:
    """A bound on the last turn's prompt plus its answer: the system prompt, every turn's user
    text and answer, and the chat template's few tokens around each message."""
    return args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens) + 8 * (2 * args.turns + 1)


def main(args: argparse.Namespace) -> int:
    args.model_path = _model_path(args.model)
    args.context = _context(args.model_path)
    if (need := max(longest_history(args), 2048 + args.answer_tokens)) > args.context:    # 2048: --fresh-prompts
        raise ConfigError(f"the conversations reach {need} tokens, over the model's context of {args.context} "
                          f"({args.model_path}): lower --turns, --user-tokens, --system-tokens or --answer-tokens")
    out = Path(args.out) / f"multiturn-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    on, off, pairs = _run_all(args, out)
    names = ("prefix+rr", "decode-first" if args.decode_first else "store+ca") if args.realistic else ("off", "on")
    lines = []
    if args.realistic:
        other = ("'decode-first' = decode-first routing on the engines' KV events (store off)" if args.decode_first
                 else "'store+ca' = store + cache-aware routing")
        blocks = (f"{args.kv_blocks} KV blocks per engine" if args.decode_kv_blocks in (0, args.kv_blocks)
                  else f"{args.kv_blocks} KV blocks per prefill engine, {args.decode_kv_blocks} on the decode node")
        lines.append(f"realistic: 2P1D, prefix caches on, {blocks}, {args.users} users; "
                     f"'prefix+rr' = prefix cache only, round-robin; {other}")
    lines.append(f"{'turn':>4} {'history tok':>11} {'TTFT ' + names[0] + ' ms':>15} {'TTFT ' + names[1] + ' ms':>14} "
                 f"{'speed-up':>8}")
    rows = []
    for turn in sorted(on["ttft"]):
        a, b = statistics.median(off["ttft"][turn]), statistics.median(on["ttft"][turn])
        n = int(statistics.median(on["history_tokens"][turn]))
        rows.append({"turn": turn, "history_tokens": n, "ttft_off_ms": 1e3 * a, "ttft_on_ms": 1e3 * b,
                     "speedup": a / b})
        lines.append(f"{turn:>4} {n:>11} {1e3 * a:>15.0f} {1e3 * b:>14.0f} {a / b:>8.2f}")
    long_off, long_on = _long_turns(off, args.long_history), _long_turns(on, args.long_history)
    hit, over = _summary(args, names, on, off, pairs, lines)
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    (out / "multiturn.json").write_text(json.dumps({"args": vars(args), "rows": rows, "on": on, "off": off, "overhead_pairs": pairs,
                                                    "hit_rate": hit, "store_overhead": over,
                                                    "long_history_ttft": {"tokens": args.long_history, names[0]: long_off,
                                                                          names[1]: long_on}},
                                                   indent=2, default=str))
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay bench multiturn")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["history_tokens"] for r in rows], [r["ttft_off_ms"] for r in rows], marker="o", label=names[0])
    ax.plot([r["history_tokens"] for r in rows], [r["ttft_on_ms"] for r in rows], marker="o", label=names[1])
    ax.set_xlabel("prompt tokens (history)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "multiturn_ttft.png", dpi=120)
    print(f"wrote {out}/multiturn.json, table.txt, multiturn_ttft.png", file=sys.stderr)
    return 0
