"""`kvrelay bench serve`: goodput under load, measured with vLLM's own serving-benchmark client.

Systems, one at a time on this host, same model, same requests:

* ``single``       - one plain vLLM server with all cores;
* ``kvrelay-tcp``, ``kvrelay-nixl`` - kvrelay 1P1D through its router with its defaults (every
  token from the decode node, decode-first routing on the engines' KV events);
* ``-nodf``: decode-first off; ``-df``: forced on; ``-p``: token 1 from the prefill node
  (``router.first_token: prefill``); ``-d-df``: every token from D and decode-first on, named
  as the runs before 2026-12-07 named today's defaults;
* ``nixl-fair``    - vLLM's NixlConnector 1P1D with its CPU faults fixed (:mod:`kvrelay.bench.fair_nixl`)
                     behind a minimal proxy doing the toy-proxy flow (P with ``max_tokens=1``,
                     then D streams with P's ``kv_transfer_params``).

Load: ``vllm bench serve`` (vLLM's client, run as a child process) with Poisson arrivals
(burstiness 1) at each rate of ``--rates``, over its ``random`` dataset: every prompt starts
with the same ``--prefix-len`` tokens (a shared system prompt, so prefix caches and the
store have something to reuse) followed by a random body of ``--input-len`` tokens
+- ``--range-ratio``; answers are ``--output-len`` +- ``--range-ratio`` tokens, EOS ignored.
The SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``) is the same for every system; goodput is
the client's ``request_goodput``: completed requests per second that met both.

``--base-url URL`` measures a running OpenAI-compatible endpoint instead (a kvrelay router, a
plain vLLM, a peer's proxy), as ``vllm bench serve --base-url`` does: nothing is started, the
model is the endpoint's own (``/v1/models``) unless ``--model``, the API key comes from
``--api-key`` or ``OPENAI_API_KEY`` and reaches the client through its environment.

``--rates auto`` finds each system's knee: rates from ``--rate-start`` up by ``--rate-step``
until the system's goodput falls below 90 % of the offered rate (or ``--rate-max``); its
capacity is the highest rate whose goodput met the SLO that well, reported beside the others'.

Writes one vLLM result JSON per (system, rate) under ``--out``/serve-*/, a combined
``serve.json`` (the same fields, plus the load and SLO), a table, and ``serve.png``
(latency and goodput against rate). Ratios are against ``nixl-fair`` and ``single`` at
the same rate, from the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.bench import e2e, report, stack_flags
from kvrelay.bench.baselines import Servers
from kvrelay.common.errors import ConfigError, UnreachableError
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch

SYSTEMS = ("single", "kvrelay-tcp", "kvrelay-nixl", "nixl-fair", "kvrelay-tcp-nodf", "kvrelay-nixl-nodf",
           "kvrelay-tcp-p", "kvrelay-nixl-p", "kvrelay-tcp-df", "kvrelay-nixl-df", "kvrelay-tcp-d-df",
           "kvrelay-nixl-d-df")
DEFAULT_SYSTEMS = SYSTEMS[:4]
KNEE = 0.9          # a rate is served while goodput >= 90 % of it
METRICS = ("ttft", "tpot", "itl", "e2el")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="", help="comma list of " + ", ".join(SYSTEMS) + " (default: "
                   + ",".join(DEFAULT_SYSTEMS) + "; none with --base-url unless named)")
    p.add_argument("--rates", default="1,2,3,4", help="Poisson request rates to sweep (req/s, comma list), or "
                   "'auto': up from --rate-start by --rate-step until each system's goodput < 90%% of the rate")
    p.add_argument("--rate-start", type=float, default=1.0, help="--rates auto: first rate")
    p.add_argument("--rate-step", type=float, default=1.5, help="--rates auto: each rate is the last times this")
    p.add_argument("--rate-max", type=float, default=32.0, help="--rates auto: never above this")
    p.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    p.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens at the start of every prompt")
    p.add_argument("--input-len", type=int, default=512, help="random body tokens after the prefix (mean)")
    p.add_argument("--output-len", type=int, default=32, help="answer tokens (mean; EOS ignored)")
    p.add_argument("--range-ratio", type=float, default=0.75, help="body and answer lengths vary by +- this fraction")
    p.add_argument("--slo-ttft-ms", type=float, default=400.0, help="SLO: time to first token")
    p.add_argument("--slo-tpot-ms", type=float, default=30.0, help="SLO: time per output token after the first")
    p.add_argument("--prefill-batch-tokens", type=int, default=0,
                   help="P's --max-num-batched-tokens for both PD systems (0 = vLLM's, as the single baseline and `kvrelay up`)")
    p.add_argument("--base-url", action="append", default=[], metavar="[NAME=]URL",
                   help="measure this running endpoint (e.g. http://router:8000) instead of starting systems; "
                   "repeat to compare several in one run (ratios are against the first)")
    p.add_argument("--model", default="", help="model to ask for (--base-url; default: the endpoint's first "
                   "from /v1/models)")
    p.add_argument("--tokenizer", default="", help="tokenizer for prompt lengths (--base-url; default: the model "
                   "name, or the built-in tiny model's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="bearer key for --base-url (default: $OPENAI_API_KEY; never put on the client's command line)")
    p.add_argument("--base-port", type=int, default=19300)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--quick", action="store_true", help="rates 1,3 and 16 prompts each")
    stack_flags.add_args(p)


# ------------------------------------------------------------------ the NixlConnector proxy
def run_nixl_proxy(port: int, p_url: str, d_url: str) -> None:
    """The toy-proxy flow for vLLM's NixlConnector: P computes (max_tokens=1), D streams with P's params."""
    import aiohttp
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        req = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        pre = dict(req, max_tokens=1, stream=False, kv_transfer_params=e2e.NIXL_PREFILL_PARAMS)
        pre.pop("stream_options", None)
        async with session.post(f"{p_url}/v1/completions", json=pre) as r:
            params = (await r.json()).get("kv_transfer_params")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with session.post(f"{d_url}/v1/completions", json=dict(req, kv_transfer_params=params)) as r:
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def session_ctx(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                               connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ------------------------------------------------------------------ systems
class System:
    """One system under test: ``start()`` returns the URL the client talks to; ``stop()`` tears it all down."""

    def __init__(self, name: str, args: argparse.Namespace, out: Path) -> None:
        self.name, self.args, self.out = name, args, out / name
        self.servers = Servers(self.out / "logs")
        self.stack: launch.Stack | None = None
        self.proxy: Any = None

    def start(self) -> str:
        if self.name in self.args.endpoints:     # a running endpoint: nothing to start
            return str(self.args.endpoints[self.name])
        if self.name == "single":
            return e2e.start_single(e2e.base_cfg(self.args, self.out), self.servers, self.args.base_port)
        if self.name.startswith("kvrelay-"):
            parts = self.name.split("-")
            over: dict[str, Any] = {"transport__backend": parts[1], "router__max_inflight": 1024,
                                    "router__decode_first": True if "df" in parts else False if "nodf" in parts else None}
            if "p" in parts or "d" in parts:                  # else kvrelay's default
                over["router__first_token"] = "prefill" if "p" in parts else "decode"
            cfg = e2e.base_cfg(self.args, self.out, **over)
            self.stack = launch.Stack(cfg)
            self.stack.start(progress=False)
            return f"http://127.0.0.1:{cfg.router.port}"
        cfg = e2e.base_cfg(self.args, self.out)
        p_url, d_url = e2e.start_nixl_pair(cfg, self.servers, self.name, True, self.args.base_port)
        port = self.args.base_port + 60
        self.proxy = mp.get_context("spawn").Process(target=run_nixl_proxy, args=(port, p_url, d_url), daemon=True)
        self.proxy.start()
        url = f"http://127.0.0.1:{port}"
        launch.wait_healthy(url, None, 60)
        return url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.join(10)
        if self.stack is not None:
            self.stack.stop()
        self.servers.stop()


# ------------------------------------------------------------------ the client
def client_command(args: argparse.Namespace, url: str, rate: float, num_prompts: int, result: Path) -> list[str]:
    """``vllm bench serve`` for one rate; its result JSON goes to ``result``."""
    model = args.model or launch.TINY_NAME
    tokenizer = args.tokenizer or (str(launch.model_path(kcfg.from_dict({}))) if model == launch.TINY_NAME else model)
    return [sys.executable, "-m", "kvrelay.bench.vllm_client", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-prefix-len", str(args.prefix_len),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio), "--ignore-eos",
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--burstiness", "1.0",
            "--seed", str(int(rate * 1000)), "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", "50,90,99",
            "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
            "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-detailed"]


def run_rate(args: argparse.Namespace, url: str, rate: float, num_prompts: int, result: Path) -> dict:
    cmd = client_command(args, url, rate, num_prompts, result)
    result.parent.mkdir(parents=True, exist_ok=True)
    log = result.with_suffix(".log")
    env = dict(os.environ, **({"OPENAI_API_KEY": args.api_key} if args.api_key else {}))
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (rc={rc}); see {log}:\n" + log.read_text()[-3000:])
    return dict(json.loads(result.read_text()))


def _row(system: str, rate: float, res: dict) -> dict:
    row: dict[str, Any] = {"system": system, "rate": rate, "completed": res.get("completed"),
                           "failed": res.get("failed", 0), "throughput": res.get("request_throughput"),
                           "goodput": res.get("request_goodput"), "tok_s": res.get("output_throughput")}
    for m in METRICS:
        for q in ("50", "90", "99"):
            row[f"{m}_p{q}"] = res.get(f"p{q}_{m}_ms", res.get(f"median_{m}_ms") if q == "50" else None)
    gaps = [1000 * itl[0] for itl in res.get("itls") or () if itl]      # token 1 -> token 2, per request
    # numpy's percentiles, as vLLM's client computes its own
    row["gap12_p50"], row["gap12_p99"] = (float(q) for q in np.percentile(gaps, [50, 99])) if gaps else (None, None)
    return row


# ------------------------------------------------------------------ report
def table(rows: list[dict], peers: tuple[str, str] = ("nixl-fair", "single")) -> str:
    """One row per (system, rate); goodput and TTFT also as ratios against ``peers`` at the same rate."""
    ref = {(r["system"], r["rate"]): r for r in rows}
    a, b = peers
    hdr = (f"{'system':<13} {'rate':>5} {'done':>5} {'req/s':>6} {'goodput':>7} {'gp/' + a[:6]:>9} {'gp/' + b[:6]:>9} "
           f"{'TTFT p50':>8} {'p90':>7} {'p99':>7} {'TTFT/' + a[:6]:>11} {'ITL p50':>7} {'p90':>6} {'p99':>6} "
           f"{'ITL99/' + a[:6]:>12} {'tok1>2 p50':>10} {'p99':>6} {'TPOT p50':>8} {'E2E p50':>8}")
    lines = [hdr]
    for r in rows:
        fair, single = ref.get((a, r["rate"])), ref.get((b, r["rate"]))

        def ratio(x: float | None, peer: dict | None, key: str) -> float:
            return x / peer[key] if x is not None and peer and peer.get(key) else float("nan")

        lines.append(f"{r['system']:<13} {r['rate']:>5g} {r['completed']:>5} {r['throughput']:>6.2f} "
                     f"{r['goodput']:>7.2f} {ratio(r['goodput'], fair, 'goodput'):>9.2f} "
                     f"{ratio(r['goodput'], single, 'goodput'):>9.2f} "
                     f"{r['ttft_p50']:>8.1f} {r['ttft_p90']:>7.1f} {r['ttft_p99']:>7.1f} "
                     f"{ratio(r['ttft_p50'], fair, 'ttft_p50'):>11.2f} "
                     f"{r['itl_p50']:>7.2f} {r['itl_p90']:>6.2f} {r['itl_p99']:>6.2f} "
                     f"{ratio(r['itl_p99'], fair, 'itl_p99'):>12.2f} {_ms(r.get('gap12_p50')):>10} "
                     f"{_ms(r.get('gap12_p99')):>6} {r['tpot_p50']:>8.2f} {r['e2el_p50']:>8.1f}")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(rows: list[dict], slo: dict, path: Path) -> None:
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay bench serve")

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = sorted((r["rate"], r) for r in rows if r["system"] == system)
        rates = [p[0] for p in pts]
        axes[0].plot(rates, [p[1]["ttft_p50"] for p in pts], marker="o", label=f"{system} p50")
        axes[0].plot(rates, [p[1]["ttft_p90"] for p in pts], ls="--", color=axes[0].lines[-1].get_color())
        axes[1].plot(rates, [p[1]["itl_p50"] for p in pts], marker="o", label=f"{system} p50")
        axes[1].plot(rates, [p[1]["itl_p99"] for p in pts], ls="--", color=axes[1].lines[-1].get_color())
        axes[2].plot(rates, [p[1]["goodput"] for p in pts], marker="o", label=system)
    axes[0].axhline(slo["ttft_ms"], color="k", lw=0.8, ls=":")
    axes[0].set(title="TTFT (solid p50, dashed p90)", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    axes[1].set(title="ITL (solid p50, dashed p99)", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    axes[2].set(title=f"goodput (TTFT<={slo['ttft_ms']:g} ms, TPOT<={slo['tpot_ms']:g} ms)",
                xlabel="request rate (req/s)", ylabel="req/s meeting the SLO")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def endpoint_label(url: str) -> str:
    """``http://router:8000/`` -> ``router:8000``: the table's name of an unnamed endpoint."""
    return url.split("://", 1)[-1].rstrip("/")


def endpoints(items: list[str]) -> dict[str, str]:
    """``--base-url`` values as ``{name: url}``, in order (``NAME=URL`` or a bare URL)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or "://" in name:
            name, url = endpoint_label(item), item
        if "://" not in url:
            raise ConfigError(f"--base-url {item!r}: expected [NAME=]http://HOST:PORT")
        out[name] = url.rstrip("/")
    return out


def endpoint_model(url: str, api_key: str) -> str:
    """The first model a running endpoint serves (``GET /v1/models``); UnreachableError if it does not answer."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url.rstrip('/')}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        raise UnreachableError(f"--base-url {url}: GET /v1/models failed ({exc}); is it an OpenAI-compatible "
                               "server, and does it need --api-key?") from exc


def ladder(args: argparse.Namespace) -> list[float]:
    """The rates to offer: the list given, or (auto) start, start x step, ... up to --rate-max."""
    if args.rates != "auto":
        return [float(r) for r in args.rates.split(",")]
    rates, r = [], args.rate_start
    while r <= args.rate_max + 1e-9:
        rates.append(round(r, 2))
        r *= args.rate_step
    return rates


def served(row: dict) -> bool:
    return (row["goodput"] or 0.0) >= KNEE * row["rate"]


def capacities(rows: list[dict]) -> dict[str, float]:
    """Per system: the highest rate it served (goodput >= 90 % of the rate), 0 if none."""
    out: dict[str, float] = {}
    for r in rows:
        out.setdefault(r["system"], 0.0)
        if served(r):
            out[r["system"]] = max(out[r["system"]], r["rate"])
    return out


def capacity_table(caps: dict[str, float], peers: tuple[str, str]) -> str:
    lines = [f"{'system':<16} {'capacity req/s':>14} {'/ ' + peers[0]:>12} {'/ ' + peers[1]:>12}"]
    for name, cap in caps.items():
        rel = [cap / caps[p] if caps.get(p) else float("nan") for p in peers]
        lines.append(f"{name:<16} {cap:>14g} {rel[0]:>12.2f} {rel[1]:>12.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from kvrelay.common.optional import need

    tqdm = need("tqdm", "bench", "kvrelay bench serve").tqdm
    if args.quick:
        args.rates, args.num_prompts = "1,3", 16
    rates = ladder(args)
    args.endpoints = endpoints(args.base_url)
    named = [s for s in args.systems.split(",") if s] or ([] if args.endpoints else list(DEFAULT_SYSTEMS))
    if unknown := set(named) - set(SYSTEMS):
        raise ConfigError(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    systems = named + list(args.endpoints)
    if args.endpoints:
        args.model = args.model or endpoint_model(next(iter(args.endpoints.values())), args.api_key)
    out = Path(args.out) / f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    load = {k: getattr(args, k) for k in ("prefix_len", "input_len", "output_len", "range_ratio", "num_prompts")}
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    print(f"load: Poisson arrivals; prompt = {args.prefix_len} shared + {args.input_len} +- "
          f"{100 * args.range_ratio:.0f}% random tokens; answer {args.output_len} +- {100 * args.range_ratio:.0f}% "
          f"tokens; {args.num_prompts} requests per rate. SLO: TTFT <= {args.slo_ttft_ms:g} ms and "
          f"TPOT <= {args.slo_tpot_ms:g} ms", file=sys.stderr)
    bar = tqdm(total=len(systems) * len(rates), desc="bench serve", unit="rate")
    rows: list[dict] = []
    results: dict[str, dict] = {}
    for name in systems:
        system = System(name, args, out)
        try:
            bar.set_postfix_str(f"{name}: starting")
            url = system.start()
            run_rate(args, url, 1.0, 4, out / name / "warmup.json")      # compile graphs, fill the prefix cache
            for rate in rates:
                bar.set_postfix_str(f"{name} @ {rate:g} req/s")
                res = run_rate(args, url, rate, args.num_prompts, out / name / f"rate-{rate:g}.json")
                results[f"{name}@{rate:g}"] = res
                rows.append(_row(name, rate, res))
                bar.update(1)
                if args.rates == "auto" and not served(rows[-1]):       # past this system's knee
                    break
        finally:
            system.stop()
    bar.close()
    peers = ("nixl-fair", "single") if {"nixl-fair", "single"} <= set(systems) else (systems[0], systems[0])
    caps = capacities(rows)
    report.write_report(out, table(rows, peers) + "\n\ncapacity (highest rate with goodput >= 90 % of it):\n"
                        + capacity_table(caps, peers),
                     ("serve.json", {"load": load, "slo": slo, "rates": rates, "rows": rows, "capacity": caps,
                                     "vllm_results": results, "host": {"cpus": os.cpu_count()},
                                     "endpoints": args.endpoints, "model": args.model}),
                     ("serve.png", lambda path: plot(rows, slo, path)))
    return 0
