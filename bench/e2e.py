"""`kvrelay bench e2e`: TTFT / ITL of PD serving vs one vLLM and vs vLLM's NixlConnector flow.

Systems, all on this machine, same model, same prompts (each request gets a fresh
random prompt so no system profits from prefix caching):

* ``single``      - one plain vLLM server with all cores;
* ``single-p``    - one plain vLLM server on the prefill node's cores only (the same compute
                    that produces kvrelay's first token);
* ``kvrelay-B``   - kvrelay 1P1D through the router, transport B (tcp, nixl), every token from D
                    (the default ``router.first_token: decode``; ``kvrelay-B-p``: token 1 from P;
                    ``--first-token decode,prefill`` runs both; before 2026-12-07: ``-d`` and plain);
* ``nixl-stock``  - vLLM's NixlConnector P/D with the toy-proxy flow (P with
                    ``max_tokens=1`` + ``do_remote_decode``, then D with P's params), as shipped;
* ``nixl-fair``   - the same with :class:`kvrelay.bench.fair_nixl.FairNixlConnector` (no core pinning,
                    no busy progress thread): the fair peer.

Interleaved (the default): every system is started first and then the same prompt goes to
each system in turn, the order rotating from one repetition to the next, so a drift in this
shared host's speed (it moves by 2x within minutes) hits every system alike. Besides the ratios
of medians, the table gives the median of *paired* ratios (each request against the same
prompt's request to ``single-p`` / ``nixl-fair`` in the same round). ``nixl-stock`` pins cores
and spins even when idle, so it always runs alone, after the others. ``--sequential`` runs
one system after the other, as earlier versions did. Every system first gets one untimed request per
length (a prompt no round uses), so no round pays the first request's one-time costs.

Exposed transfer time (kvrelay only, from the connectors' event log): from the later
of "D installs chunk 0" and "P's KV is complete" (P starts pushing the last chunk) to
"D finished installing the last chunk" - the part of the transfer that did not
overlap P's compute. It is reported against one chunk's transfer time measured in
the same run (push start -> installed, 1-chunk prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvrelay.bench import report, stack_flags
from kvrelay.bench.baselines import Servers
from kvrelay.core import config as kcfg
from kvrelay.core.router_config import FirstToken
from kvrelay.core.telemetry import read_events
from kvrelay.deploy import launch, tiny_model

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;:!?0123456789\n"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", default="1,2,4,8,16", help="prompt lengths in chunks (comma list)")
    p.add_argument("--reps", type=int, default=3, help="requests per length and system")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens per request")
    p.add_argument("--backends", default="tcp,nixl", help="kvrelay transports to run")
    p.add_argument("--systems", default="single,single-p,kvrelay,nixl-fair,nixl-stock",
                   help="systems to compare (comma list): single (one vLLM on both cores), single-p (one vLLM on "
                        "P's core), kvrelay, nixl-fair and nixl-stock (vLLM's NixlConnector with kvrelay's engine "
                        "flags, and as vLLM ships it)")
    p.add_argument("--first-token", default=FirstToken.DECODE.value,
                   help="kvrelay router.first_token settings to run (comma list; the default is kvrelay's)")
    p.add_argument("--prefill-tp", default="1", help="kvrelay prefill TP sizes to run (comma list, e.g. 1,2: one "
                   "kvrelay system each; engine.prefill_tp)")
    p.add_argument("--decode-tp", type=int, default=1, help="kvrelay decode TP size (engine.decode_tp)")
    p.add_argument("--decode-first", default="auto",
                   help="kvrelay router.decode_first settings to run (comma list of auto/on/off; auto, the "
                        "default, is kvrelay's own default - decode-first on the engines' KV events, D alone up "
                        "to --disagg-min-tokens; 'on' systems are labelled -df, 'off' ones -nodf)")
    p.add_argument("--disagg-min-tokens", type=int, default=-1,
                   help="router.disagg_min_tokens and disagg_min_tokens_idle of the decode-first systems "
                        "(-1 = the configured defaults)")
    p.add_argument("--prefill-batch-tokens", type=int, default=0,
                   help="P's --max-num-batched-tokens (0 = vLLM's, as the single baselines run; a smaller "
                        "batch lets a long prompt's pushes overlap its later chunks but costs TTFT)")
    p.add_argument("--sequential", action="store_true",
                   help="run one system after the other instead of interleaving their requests")
    p.add_argument("--pause-ms", type=float, default=50.0,
                   help="idle time between two requests (lets the previous system settle)")
    p.add_argument("--base-port", type=int, default=19100,
                   help="first port; interleaved, system i uses the 1,000 ports from base + 1000 i")
    p.add_argument("--out", default="bench_results", help="directory for the JSON, table and PNG")
    p.add_argument("--quick", action="store_true", help="chunks 1,4,16, 1 rep")
    stack_flags.add_args(p)


def _prompt(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n_tokens))


def _stream(url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None,
            headers: dict | None = None, t0: float | None = None) -> tuple[float, list[float]]:
    """Stream one completion; return (TTFT seconds, inter-token gaps)."""
    import urllib.request

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    start = time.perf_counter() if t0 is None else t0
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                ev = json.loads(line[5:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no tokens streamed")
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return times[0] - start, gaps


def _post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read()))


def base_cfg(args: argparse.Namespace, out: Path, port: int = 0, **over: Any) -> kcfg.KVRelayConfig:
    """One system's config; ``port`` (default ``--base-port``) is the first of the 1,000 it may use;
    ``over`` (``section__key``) is what this system of the comparison sets."""
    port = port or args.base_port
    data: dict[str, Any] = {
        "engine": {"served_model_name": launch.TINY_NAME},      # the model's own context (the tiny one: 4,096)
        "deploy": {"base_port": port, "kv_base_port": port + 500, "log_dir": str(out / "logs")},
        "router": {"port": port + 50},
        "connector": {"events_path": str(out / "events.jsonl")},
    }
    if args.prefill_batch_tokens:
        data["engine"]["prefill_args"] = ["--max-num-batched-tokens", str(args.prefill_batch_tokens)]
    for key, value in over.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return stack_flags.build(args, data)          # the user's --config and config flags (bench/stack_flags.py)


Flow = Callable[[str, str], tuple[float, list[float]]]     # (prompt, request id) -> (TTFT s, gaps s)


@dataclass
class System:
    """One running system under test: how to send it a request, how to stop it, and (kvrelay)
    how to read its exposed transfer time afterwards."""

    label: str
    flow: Flow
    stop: Callable[[], None]
    transfer: Callable[[], dict] | None = None
    reps: int = 0                                            # 0: --reps
    url: str = ""                                            # where clients send requests
    cfg: kcfg.KVRelayConfig | None = None                    # the config it was started with


@dataclass
class Samples:
    """Every request's TTFT and gaps, by (system, prompt tokens, repetition)."""

    ttft: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)
    gaps: dict[tuple[str, int], dict[int, list[float]]] = field(default_factory=dict)

    def add(self, label: str, n: int, rep: int, ttft: float, gaps: list[float]) -> None:
        self.ttft.setdefault((label, n), {})[rep] = ttft
        self.gaps.setdefault((label, n), {})[rep] = gaps


def rotation(labels: list[str], rep: int) -> list[str]:
    """The order of round ``rep``: each system goes first (and last) equally often."""
    k = rep % len(labels) if labels else 0
    return labels[k:] + labels[:k]


def paired_ratio(samples: Samples, label: str, peer: str, n: int) -> float:
    """Median over the rounds both ran of ``label``'s TTFT / ``peer``'s for the same prompt."""
    mine, theirs = samples.ttft.get((label, n), {}), samples.ttft.get((peer, n), {})
    ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
    return statistics.median(ratios) if ratios else float("nan")


def _one(system: System, n: int, rep: int, samples: Samples, pause_s: float) -> None:
    rid = f"b-{system.label}-{n}-{rep}-{uuid.uuid4().hex[:6]}"
    ttft, gaps = system.flow(_prompt(n, 1000 * n + rep), rid)      # same prompts for every system
    samples.add(system.label, n, rep, ttft, gaps)
    time.sleep(pause_s)


def warm_up(system: System, lengths: list[int]) -> None:
    """One untimed request per length (a prompt no round uses): the first request of each shape
    pays one-time costs (allocations, connections) that no later one does."""
    for n in lengths:
        system.flow(_prompt(n, 999_999 + n), f"warm-{system.label}-{n}-{uuid.uuid4().hex[:6]}")


def measure_interleaved(systems: list[System], lengths: list[int], reps: int, samples: Samples,
                        bar: Any, pause_s: float = 0.05) -> None:
    """Round ``rep`` of length ``n`` sends the same prompt to every system, in a rotating order."""
    by_label = {s.label: s for s in systems}
    for s in systems:
        warm_up(s, lengths)
    for n in lengths:
        for rep in range(reps):
            for label in rotation(list(by_label), rep):
                _one(by_label[label], n, rep, samples, pause_s)
                bar.update(1)


def measure_one(system: System, lengths: list[int], reps: int, samples: Samples, bar: Any,
                pause_s: float = 0.05) -> None:
    measure_interleaved([system], lengths, system.reps or reps, samples, bar, pause_s)


def rows_of(samples: Samples, labels: list[str], lengths: list[int]) -> list[dict]:
    """One row per (system, length): medians, tail quantiles, and paired ratios."""
    rows = []
    for label in labels:
        for n in lengths:
            ttft_by_rep = samples.ttft.get((label, n))
            if not ttft_by_rep:
                continue
            ttfts = list(ttft_by_rep.values())
            gaps_by_rep = samples.gaps[(label, n)]
            itls = [g for r in gaps_by_rep for g in gaps_by_rep[r]]
            totals = [ttft_by_rep[r] + sum(gaps_by_rep[r]) for r in ttft_by_rep]   # request sent -> last token
            q = sorted(ttfts)
            rows.append({"system": label, "prompt_tokens": n, "ttft_ms": 1e3 * statistics.median(ttfts),
                         "ttft_p90_ms": 1e3 * q[min(len(q) - 1, int(0.9 * len(q)))],
                         "ttft_p99_ms": 1e3 * q[min(len(q) - 1, int(0.99 * len(q)))],
                         "itl_ms": 1e3 * statistics.median(itls) if itls else float("nan"),
                         "total_ms": 1e3 * statistics.median(totals),
                         "paired_vs_single_p": paired_ratio(samples, label, "single-p", n),
                         "paired_vs_nixl_fair": paired_ratio(samples, label, "nixl-fair", n),
                         "ttft_all_ms": [round(1e3 * t, 2) for t in ttfts]})
    return rows


def start_single(cfg: kcfg.KVRelayConfig, servers: Servers, base_port: int) -> str:
    """Start one plain vLLM server (the cores ``cfg.engine.cpu_bind`` gives it); return its URL."""
    spec = launch.NodeSpec(launch.Role.SINGLE, 0, base_port + 90)
    servers.start("single", launch.server_command(cfg, spec), launch.server_env(cfg, 0, 1))
    url = f"http://127.0.0.1:{spec.port}"
    launch.wait_healthy(url, servers.procs[-1], 900)
    return url


def up_single(args: argparse.Namespace, out: Path, label: str, port: int) -> System:
    over = {}
    if label == "single-p":                      # the cores `kvrelay up` gives prefill node 0 of a 1P1D stack
        over["engine__cpu_bind"] = ",".join(map(str, launch.split_cores(0, 2)))
    cfg = base_cfg(args, out / label, port, **over)
    servers = Servers(out / label / "logs")
    try:
        url = start_single(cfg, servers, port)
    except BaseException:
        servers.stop()
        raise
    return System(label, lambda p, rid: _stream(url, launch.TINY_NAME, p, args.max_tokens), servers.stop,
                  url=url, cfg=cfg)


DECODE_FIRST = {"auto": None, "on": True, "off": False}     # --decode-first: router.decode_first
CONTEXT = tiny_model.MAX_POSITIONS     # the longest prompt + answer asked: within the tiny model's context


def kvrelay_label(backend: str, first_token: str, p_tp: int, d_tp: int, decode_first: bool | None = None) -> str:
    """``kvrelay-tcp`` (kvrelay's defaults), ``kvrelay-nixl-p`` (token 1 from P), ``kvrelay-tcp-tp2x1``
    (prefill TP2, decode TP1), ``kvrelay-tcp-df`` / ``-nodf`` (decode-first routing forced on / off)."""
    tp = f"-tp{p_tp}x{d_tp}" if (p_tp, d_tp) != (1, 1) else ""
    df = {None: "", True: "-df", False: "-nodf"}[decode_first]
    return f"kvrelay-{backend}" + ("-p" if first_token == FirstToken.PREFILL.value else "") + tp + df


def up_kvrelay(args: argparse.Namespace, out: Path, backend: str, first_token: str, port: int,
               p_tp: int = 1, d_tp: int = 1, decode_first: bool | None = None) -> System:
    label = kvrelay_label(backend, first_token, p_tp, d_tp, decode_first)
    sub = out / label
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "events.jsonl").unlink(missing_ok=True)
    over: dict[str, Any] = {"router__decode_first": decode_first}       # None: auto, kvrelay's default
    if decode_first is not False and args.disagg_min_tokens >= 0:   # both bounds: D is idle or busy as the run goes
        over["router__disagg_min_tokens"] = over["router__disagg_min_tokens_idle"] = args.disagg_min_tokens
    cfg = base_cfg(args, sub, port, transport__backend=backend, router__first_token=first_token,
                   engine__prefill_tp=p_tp, engine__decode_tp=d_tp, **over)
    stack = launch.Stack(cfg)
    try:
        stack.start(progress=False)
    except BaseException:
        stack.stop()
        raise
    url = f"http://127.0.0.1:{cfg.router.port}"
    return System(label,
                  lambda p, rid: _stream(url, launch.TINY_NAME, p, args.max_tokens, headers={"X-Request-Id": rid}),
                  stack.stop, lambda: exposed_transfer(sub / "events.jsonl", cfg.chunk_tokens), url=url, cfg=cfg)


def exposed_transfer(events_path: Path, chunk_tokens: int) -> dict:
    """Per prompt length: median exposed transfer (ms) and one chunk's transfer time (ms)."""
    evs = read_events(events_path)
    by_tid: dict[str, list[dict]] = {}
    for e in evs:             # a request's sub-transfers (tid#pN: one per prefill rank) and every rank together
        by_tid.setdefault(e.get("transfer", "").split("#")[0], []).append(e)
    exposed: dict[int, list[float]] = {}
    one_chunk: list[float] = []
    for group in by_tid.values():
        done = [e for e in group if e["event"] == "load_done"]
        installs = [e for e in group if e["event"] == "install"]
        starts: dict[int, float] = {}
        for e in group:                  # with TP, each piece of a chunk starts on its own rank: the first
            if e["event"] == "push_start":
                starts[e["chunk"]] = min(e["t"], starts.get(e["chunk"], e["t"]))
        if not done or not installs or not starts:
            continue
        n = done[0]["chunks"]         # the last piece of the last chunk, on whichever rank, ends it
        last_start = starts.get(n - 1, max(starts.values()))
        first_install = min(e["t_start"] for e in installs)
        last_end = max(e["t_end"] for e in installs)
        exposed.setdefault(done[0]["prompt_tokens"], []).append(last_end - max(first_install, last_start))
        if n == 1:
            one_chunk.append(last_end - starts[0])
    chunk_ms = 1e3 * statistics.median(one_chunk) if one_chunk else float("nan")
    return {"one_chunk_ms": chunk_ms,
            "exposed_ms": {n: 1e3 * statistics.median(v) for n, v in sorted(exposed.items())}}


def start_nixl_pair(cfg: kcfg.KVRelayConfig, servers: Servers, label: str, fair: bool,
                    base_port: int) -> tuple[str, str]:
    """Start vLLM's NixlConnector producer + consumer (stock, or :mod:`kvrelay.bench.fair_nixl`); return (P url, D url)."""
    ports = (base_port + 70, base_port + 71)
    kv: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    if fair:
        kv.update(kv_connector="FairNixlConnector", kv_connector_module_path="kvrelay.bench.fair_nixl")
    for k, (role, port) in enumerate(zip(("kv_producer", "kv_consumer"), ports, strict=True)):
        spec = launch.NodeSpec(launch.Role.SINGLE, k, port)
        cmd = launch.server_command(cfg, spec) + ["--kv-transfer-config", json.dumps({**kv, "kv_role": role})]
        if role == "kv_producer":
            cmd += list(cfg.engine.prefill_args)
        env = launch.server_env(cfg, k, 2)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(base_port + 80 + k)
        servers.start(f"{label}-{role}", cmd, env)
    p_url, d_url = (f"http://127.0.0.1:{p}" for p in ports)
    for url, proc in zip((p_url, d_url), servers.procs[-2:], strict=True):
        launch.wait_healthy(url, proc, 900)
    return p_url, d_url


# what the toy proxy sends P: compute the prompt, keep its KV for a remote decode
NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def up_nixl(args: argparse.Namespace, out: Path, label: str, fair: bool, port: int) -> System:
    cfg = base_cfg(args, out / label, port)
    servers = Servers(out / label / "logs")
    try:
        p_url, d_url = start_nixl_pair(cfg, servers, label, fair, port)
    except BaseException:
        servers.stop()
        raise

    def flow(prompt: str, rid: str) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        pre = _post(f"{p_url}/v1/completions", {
            "model": launch.TINY_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": NIXL_PREFILL_PARAMS})
        return _stream(d_url, launch.TINY_NAME, prompt, args.max_tokens,
                       extra={"kv_transfer_params": pre.get("kv_transfer_params")}, t0=t0)

    return System(label, flow, servers.stop, reps=1 if label == "nixl-stock" else 0)


def _plan(args: argparse.Namespace) -> list[tuple[str, Callable[[int], System]]]:
    """(label, start(port)) of every system asked for, nixl-stock last."""
    out, systems = args.out_dir, args.systems.split(",")
    plan: list[tuple[str, Callable[[int], System]]] = []
    for label in ("single", "single-p"):
        if label in systems:
            plan.append((label, partial(up_single, args, out, label)))
    if "kvrelay" in systems:
        for b in args.backends.split(","):
            for mode in args.first_token.split(","):
                for p_tp in map(int, args.prefill_tp.split(",")):
                    for df in (DECODE_FIRST[s.strip()] for s in args.decode_first.split(",")):
                        plan.append((kvrelay_label(b, mode, p_tp, args.decode_tp, df),
                                     partial(up_kvrelay, args, out, b, mode, p_tp=p_tp, d_tp=args.decode_tp,
                                             decode_first=df)))
    for label in ("nixl-fair", "nixl-stock"):
        if label in systems:
            plan.append((label, partial(up_nixl, args, out, label, label == "nixl-fair")))
    return plan


ENGINE_GIB = 2.3          # one tiny-model vLLM server's resident memory here (1 GiB KV cache + the process)


def engines_of(label: str) -> int:
    """Engine processes of a system (a TP engine has one per rank): ``kvrelay-tcp-tp2x1`` has 3."""
    if label.startswith("single"):
        return 1
    tp = re.search(r"-tp(\d+)x(\d+)", label)
    return int(tp.group(1)) + int(tp.group(2)) if tp else 2


def fits_together(labels: list[str], meminfo: str = "/proc/meminfo") -> bool:
    """Whether every system can be up at once (interleaving); if not, say so on stderr."""
    need = ENGINE_GIB * sum(engines_of(label) for label in labels)
    try:
        avail = next(int(line.split()[1]) for line in Path(meminfo).read_text().splitlines()
                     if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    if need <= 0.9 * avail:
        return True
    print(f"bench e2e: {len(labels)} systems need about {need:.0f} GiB up at once and {avail:.0f} GiB is free: "
          "running them one after the other (--sequential); the paired ratios then pair requests minutes apart",
          file=sys.stderr)
    return False


def _run(args: argparse.Namespace, lengths: list[int], samples: Samples, bar: Any) -> dict[str, dict]:
    """Run every system (interleaved unless --sequential); return kvrelay's transfer figures."""
    plan = _plan(args)
    pause = args.pause_ms / 1e3
    if not args.sequential and not fits_together([label for label, _ in plan if label != "nixl-stock"]):
        args.sequential = True
    together = [] if args.sequential else [up for label, up in plan if label != "nixl-stock"]
    alone = [up for label, up in plan if args.sequential or label == "nixl-stock"]
    running: list[System] = []
    try:
        for i, up in enumerate(together):
            running.append(up(args.base_port + 1000 * i))
        measure_interleaved(running, lengths, args.reps, samples, bar, pause)
    finally:
        for system in running:
            system.stop()
    done = list(running)
    for up in alone:
        system = up(args.base_port)
        try:
            measure_one(system, lengths, args.reps, samples, bar, pause)
        finally:
            system.stop()
        done.append(system)
    return {s.label: s.transfer() for s in done if s.transfer}    # the event logs, once their writers stopped


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.quick:
        args.chunks, args.reps = "1,4,16", 1
    chunks = [int(c) for c in args.chunks.split(",")]
    lengths = [256 * c - (0 if c > 1 else 16) for c in chunks]
    lengths[-1] = min(lengths[-1], CONTEXT - args.max_tokens)     # prompt and answer within the context
    args.out_dir = Path(args.out) / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    launch.model_path(kcfg.from_dict({}))
    labels = [label for label, _ in _plan(args)]
    n_req = len(lengths) * sum(1 if label == "nixl-stock" else args.reps for label in labels)
    bar = tqdm(total=n_req, desc="bench e2e", unit="req")
    samples = Samples()
    transfer = _run(args, lengths, samples, bar)
    bar.close()
    rows = rows_of(samples, labels, lengths)
    table = report.e2e_table(rows, transfer, not args.sequential)
    report.write_report(args.out_dir, table,
                 ("e2e.json", {"args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows,
                               "transfer": transfer, "host": {"cpus": os.cpu_count()}}),
                 ("e2e_ttft.png", partial(report.ttft_plot, rows)))
    return 0
