"""`kvrelay bench router`: what the router costs, against direct access and a toy proxy.

A scripted upstream streams tokens as fast as it can (SSE events shaped like vLLM's),
and answers the prefill leg (``max_tokens=1``, not streamed) at once. In the same run,
one system at a time sits between the client and that upstream:

* ``direct``  - no proxy: the client talks to the upstream (the floor);
* ``kvrelay`` - kvrelay's router on its split path: token 1 from the prefill leg (``first_token:
                prefill``), then the decode leg's events re-rendered into the client's stream; signed
                params, admission (the run fails if any request fell back to another path);
* ``kvrelay-df`` - the same router placing decode-first (``router.decode_first``, on by default
                wherever the router follows the engines' KV events): each prompt tokenised as vLLM
                does (the built-in tiny model's tokenizer), the decode node chosen by what it holds,
                and a prompt this short answered by D alone, tracked (D asked for its token ids, the
                router takes them out of each event) - the hop a short prompt takes in a default stack;
* ``toy``     - a proxy written the way vLLM's disaggregated-serving example is
                (FastAPI + httpx: the prefill request, then the decode stream re-yielded).

Every proxy process is pinned to one core, and for the latency runs the client shares the
upstream's core (a client on the proxy's core added its own scheduling to the proxy's tail:
p99 +12-30 ms instead of +3-5 ms); "streamed requests per second" is per proxy core. Reported:

* added latency = a system's time to the last byte minus direct's, p50 and p99, at 1 and
  at 64 concurrent streams. At 64 streams twice: with the upstream as fast as it can (every
  system saturates and the figure is mostly queueing behind the slowest process), and
  **paced** like an engine (``--pace-ms`` between tokens, one decode step), the load a
  router sees in front of real engines;
* the most streamed requests per second (64 streams for ``--duration`` seconds), as a ratio
  to the toy proxy and to direct.

The latency runs are split into ``--rounds`` rounds; each round runs every system in turn
(rotating the order, a short settle between systems), so a slow spell of the shared host
lands on all systems instead of on one system's whole run.

Each latency is also taken **net of the upstream's own time**: the upstream adds up, per
request (tagged in ``user``, which every path passes on to each leg), the time its handlers
ran, and a request's overhead is its time to the last byte minus that. ``+net`` is a
system's overhead minus direct's, quantile by quantile. The pacing sleeps' overshoot and
the extra token the toy proxy's decode leg streams sit inside the upstream's time, so they
drop out; what is left is the hops, the proxy's own work and its queueing.

Prints a table; writes ``router.json`` and ``router.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


# ------------------------------------------------------------------ the processes
def _pin(core: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})


_HEAD = {"id": "cmpl-bench", "object": "text_completion", "created": 1764547200, "model": "kvrelay-tiny"}


def _event(i: int, last: bool = False, ids: bool = False) -> bytes:
    """Token ``i``'s event; with ``ids`` as vLLM streams it under ``return_token_ids`` (the
    token's id, and the prompt's ids on the first)."""
    from kvrelay.router.split import sse

    choice: dict[str, Any] = {"index": 0, "text": f"t{i} ", "logprobs": None,
                              "finish_reason": "length" if last else None, "stop_reason": None}
    if ids:
        choice["token_ids"] = [100 + i]
        if i == 0:
            choice["prompt_token_ids"] = list(range(1, 9))
    return sse({**_HEAD, "choices": [choice]})


def _usage_event(tokens: int) -> bytes:
    from kvrelay.router.split import sse

    return sse({**_HEAD, "choices": [],
                "usage": {"prompt_tokens": 8, "total_tokens": 8 + tokens, "completion_tokens": tokens}})


# What vLLM answers a prefill leg with ``return_token_ids`` (the router's default split path needs the ids)
PREFILL_ANSWER = {"id": "cmpl-p", "object": "text_completion", "created": 1764547200, "model": "kvrelay-tiny",
                  "choices": [{"index": 0, "text": "t0", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None, "prompt_token_ids": list(range(8)), "token_ids": [8]}],
                  "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1}}


PACED_USER = "bench-paced"     # a request with this ``user`` is streamed at the engine's pace


def _user(paced: bool, tag: int) -> str:
    """The ``user`` a request carries: whether it is paced, and its tag for the upstream's accounting."""
    return f"{PACED_USER if paced else 'bench'}#{tag}"


@functools.lru_cache(maxsize=16)
def _answer_events(n: int, with_usage: bool, ids: bool = False) -> tuple[list[bytes], bytes]:
    """(``n`` token events, the tail) as vLLM streams them: the last token carries
    finish_reason; the tail is usage when asked for, then [DONE]. The decode leg behind the
    router asks for one token fewer than the client did (token 1 came from the prefill leg):
    every path delivers the same tokens."""
    tail = (_usage_event(n) if with_usage else b"") + b"data: [DONE]\n\n"
    return [_event(i, i == n - 1, ids) for i in range(n)], tail


def run_upstream(port: int, tokens: int, core: int, pace_s: float = 0.0) -> None:
    """A scripted engine: SSE tokens as fast as the loop can write them, or one every ``pace_s``
    for requests whose ``user`` is :data:`PACED_USER` (the router passes it on to the decode leg)."""
    from aiohttp import web

    _pin(core)
    served: dict[str, float] = {}        # request tag -> seconds its legs' handlers ran, summed

    async def complete(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await request.json()
        kind, _, tag = str(body.get("user") or "").partition("#")
        try:
            return await _answer(request, body, kind == PACED_USER)
        finally:
            if tag:
                served[tag] = served.get(tag, 0.0) + time.perf_counter() - t0

    async def _answer(request: web.Request, body: dict[str, Any], paced: bool) -> web.StreamResponse:
        if not body.get("stream"):           # the prefill leg: token 1 with its ids, as vLLM answers it
            if paced:
                await asyncio.sleep(pace_s)  # token 1 costs one step on this path too
            return web.json_response(PREFILL_ANSWER)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = min(int(body.get("max_tokens") or tokens), tokens)
        events, tail = _answer_events(n, bool((body.get("stream_options") or {}).get("include_usage")),
                                      bool(body.get("return_token_ids")))
        for ev in events:
            if paced:
                await asyncio.sleep(pace_s)
            await resp.write(ev)
        await resp.write(tail)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def service(request: web.Request) -> web.Response:
        """The upstream's time per request tag since the last call (and forget it)."""
        out = dict(served)
        served.clear()
        return web.json_response(out)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "kvrelay-tiny", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/bench/service", service)
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


def run_kvrelay(port: int, upstream: str, core: int, tokenizer: str = "") -> None:
    """kvrelay's router in front of the upstream (as both pools); with ``tokenizer``, placing
    decode-first with that tokenizer."""
    from kvrelay.core import config as kcfg
    from kvrelay.router.app import run

    _pin(core)
    router: dict[str, Any] = {"host": HOST, "port": port, "prefill": [upstream],
                              "decode": [f"{upstream}=tcp://{HOST}:1"], "health_interval_s": 5,
                              "max_inflight": 4096, "decode_first": bool(tokenizer), "first_token": "prefill"}
    if tokenizer:
        router["tokenizer"] = tokenizer
    run(kcfg.from_dict({"router": router}))


def run_toy(port: int, upstream: str, core: int) -> None:
    """The shape of vLLM's example proxy: FastAPI + httpx, prefill then decode, chunks re-yielded."""
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    _pin(core)
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None, base_url=upstream, limits=httpx.Limits(max_connections=None))

    async def completions(request: Request) -> StreamingResponse:
        req = await request.json()
        prefill = dict(req, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        await client.post("/v1/completions", json=prefill)

        async def decode() -> Any:
            async with client.stream("POST", "/v1/completions", json=req) as resp:
                async for chunk in resp.aiter_bytes():
                    yield chunk
        return StreamingResponse(decode(), media_type="text/event-stream")

    completions.__annotations__ = {"request": Request, "return": StreamingResponse}  # types, not strings
    app.post("/v1/completions")(completions)
    app.get("/health")(lambda: {})
    uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False)


# ------------------------------------------------------------------ the client
_TAGS = itertools.count(1)


async def _one(session: Any, url: str, paced: bool = False, tokens: int = 64,
               tag: int = 0) -> float:
    t0 = time.perf_counter()
    body = {"model": "kvrelay-tiny", "prompt": "bench", "max_tokens": tokens, "stream": True,
            "user": _user(paced, tag)}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        data = await r.read()
        if r.status != 200 or not data.endswith(b"data: [DONE]\n\n") or b'"error"' in data:
            raise RuntimeError(f"{url}: HTTP {r.status}, stream ended {data[-40:]!r}")
    return time.perf_counter() - t0


async def _latencies(url: str, upstream: str, concurrency: int, requests: int, pace_s: float = 0.0,
                     tokens: int = 64) -> tuple[list[float], list[float]]:
    """(time to the last byte, that time net of the upstream's own) of ``requests`` answers over
    ``concurrency`` closed-loop streams. Paced (``pace_s`` > 0): stream k starts k/concurrency of
    an answer later, so the streams run at spread phases as independent users do, not in
    lock-step bursts."""
    import aiohttp

    e2e: dict[str, float] = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(3):
            await _one(s, url)                                  # warm the path
        await asyncio.gather(*(_one(s, url) for _ in range(concurrency)))   # one open connection per stream
        async with s.get(f"{upstream}/bench/service") as r:     # forget the warm-up's accounting
            await r.read()

        async def worker(k: int, n: int) -> None:
            await asyncio.sleep(k * pace_s * tokens / concurrency)
            for _ in range(n):
                tag = next(_TAGS)
                e2e[str(tag)] = await _one(s, url, pace_s > 0, tokens, tag)
        per = max(1, requests // concurrency)
        await asyncio.gather(*(worker(k, per) for k in range(concurrency)))
        async with s.get(f"{upstream}/bench/service") as r:
            served: dict[str, float] = await r.json()
    missing = set(e2e) - set(served)
    if missing:
        raise RuntimeError(f"the upstream saw no leg of {len(missing)} requests (tags lost on the way)")
    return list(e2e.values()), [t - served[tag] for tag, t in e2e.items()]


async def _throughput(url: str, concurrency: int, duration: float, tokens: int = 64) -> float:
    import aiohttp

    done = 0
    stop = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await _one(s, url, tokens=tokens)
                done += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def _tokenizer() -> str:
    """The built-in tiny model's directory (its tokenizer is what the decode-first router loads)."""
    from kvrelay.core import config as kcfg
    from kvrelay.deploy.launch import model_path

    return model_path(kcfg.from_dict({}))


def _router_path(url: str, path: str) -> dict[str, float]:
    """Check that the router's requests took ``path`` (its ``kvrelay_router_decisions_total``),
    with no error or fallback counted: a measurement of the wrong path otherwise."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    ok, errors, paths = 0.0, dict[str, float](), dict[str, float]()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvrelay_router_requests_total" and s.labels.get("outcome") == "ok":
                ok += s.value
            if s.name in ("kvrelay_router_request_failures_total", "kvrelay_router_fallbacks_total") and s.value:
                errors[s.labels["cause"]] = s.value
            if s.name == "kvrelay_router_decisions_total" and s.value:
                paths[s.labels["path"]] = s.value
    if errors:    # e.g. first_token_fallback: the scripted answers lack what the split path needs
        raise RuntimeError(f"the router counted errors in the run ({errors}; {ok:.0f} requests ok): "
                           f"it did not measure its {path} path")
    if set(paths) - {path}:
        raise RuntimeError(f"the router placed requests on other paths than {path}: {paths}")
    return {"requests_ok": ok}           # any error, fallback or other path counted raised above


def _wait_up(url: str, timeout: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return                                        # 200: up (the router: both pools healthy)
        except OSError:                                       # refused, or 503 until the first health round
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not come up")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------ the run
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, help="SSE events per streamed answer")
    p.add_argument("--requests", type=int, default=512, help="requests per latency measurement")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the throughput measurement")
    p.add_argument("--rounds", type=int, default=4,
                   help="latency runs are split into this many rounds, the systems interleaved in each")
    p.add_argument("--settle-s", type=float, default=1.0, help="idle seconds between two systems' latency runs")
    p.add_argument("--pace-ms", type=float, default=10.0,
                   help="paced run: ms between an answer's tokens (an engine's decode step)")
    p.add_argument("--base-port", type=int, default=18600)
    p.add_argument("--out", default="bench-out/router", help="directory for router.json and router.png")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvrelay.common.secrets import SECRET_ENV, generate_secret

    os.environ.setdefault(SECRET_ENV, generate_secret())      # the router signs params: a throwaway secret
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    up_url = f"http://{HOST}:{args.base_port}"
    procs = [ctx.Process(target=run_upstream, args=(args.base_port, args.tokens, 1, args.pace_ms / 1e3),
                         daemon=True)]
    systems = {"direct": up_url, "kvrelay": f"http://{HOST}:{args.base_port + 1}",
               "kvrelay-df": f"http://{HOST}:{args.base_port + 3}", "toy": f"http://{HOST}:{args.base_port + 2}"}
    procs += [ctx.Process(target=run_kvrelay, args=(args.base_port + 1, up_url, 0), daemon=True),
              ctx.Process(target=run_toy, args=(args.base_port + 2, up_url, 0), daemon=True),
              ctx.Process(target=run_kvrelay, args=(args.base_port + 3, up_url, 0, _tokenizer()), daemon=True)]
    busy_pid = {"direct": 0, "kvrelay": 1, "toy": 2, "kvrelay-df": 3}   # whose core: the upstream's for direct
    for p in procs:
        p.start()
    rows: dict[str, dict[str, Any]] = {}
    try:
        for url in systems.values():
            _wait_up(url)
        bar = tqdm(total=(3 * args.rounds + 1) * len(systems), desc="bench router", unit="run")
        cores = os.sched_getaffinity(0)
        _pin(1)      # latency: the client shares the upstream's core, so the proxy's core is its alone
        try:
            rows = _latency_rows(systems, up_url, args, bar)
        finally:
            os.sched_setaffinity(0, cores)
        for name, url in systems.items():
            pid = procs[busy_pid[name]].pid
            assert pid is not None
            cpu0, t0 = _cpu_s(pid), time.perf_counter()
            rows[name]["rps"] = asyncio.run(_throughput(url, 64, args.duration, args.tokens))
            rows[name]["core_busy"] = (_cpu_s(pid) - cpu0) / (time.perf_counter() - t0)
            bar.update(1)
        bar.close()
        rows["kvrelay"]["path"] = _router_path(systems["kvrelay"], "disaggregated")
        rows["kvrelay-df"]["path"] = _router_path(systems["kvrelay-df"], "decode_only")
    finally:
        for p in procs:
            p.terminate()
            p.join(5)
    report = _report(rows, args.pace_ms)
    print(report)
    (out / "router.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}, indent=2))
    (out / "table.txt").write_text(report + "\n")
    _plot(rows, out / "router.png")
    print(f"wrote {out}/router.json, table.txt, router.png", file=sys.stderr)
    return 0


def _latency_rows(systems: dict[str, str], up_url: str, args: argparse.Namespace, bar: Any) -> dict[str, dict[str, Any]]:
    """Latency quantiles per system and load, from ``args.rounds`` interleaved rounds: each round
    runs every system in turn (the order rotating), so a slow spell of this shared host lands on
    all of them rather than on whichever system it happened to meet."""
    loads = (("c1", 1, 0.0), ("c64", 64, 0.0), ("c64paced", 64, args.pace_ms / 1e3))
    samples: dict[tuple[str, str], tuple[list[float], list[float]]] = {(name, key): ([], []) for name in systems for key, _c, _p in loads}
    names = list(systems)
    for r in range(args.rounds):
        for key, c, pace_s in loads:
            n = max(c, (args.requests // 4 if c == 1 else args.requests) // args.rounds)
            for name in names[r % len(names):] + names[:r % len(names)]:
                time.sleep(args.settle_s)     # the previous system's proxy finishes closing its connections
                lat, net = asyncio.run(_latencies(systems[name], up_url, c, n, pace_s, args.tokens))
                samples[name, key][0].extend(lat)
                samples[name, key][1].extend(net)
                bar.update(1)
    rows: dict[str, dict[str, Any]] = {name: {} for name in names}
    for (name, key), (lat, net) in samples.items():
        rows[name][key] = {"p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * _pct(lat, 0.99),
                           "net_p50_ms": 1e3 * statistics.median(net), "net_p99_ms": 1e3 * _pct(net, 0.99),
                           "n": len(lat)}
    return rows


def _report(rows: dict[str, dict[str, Any]], pace_ms: float) -> str:
    d = rows["direct"]

    def added(r: dict[str, Any], key: str, q: str) -> float:
        return float(r[key][q] - d[key][q])

    lines = [f"{'system':<9} {'c1 p50':>8} {'c1 p99':>8} {'c64 p50':>8} {'c64 p99':>8} {'+c1 p50':>8} "
             f"{'+c64 p50':>8} {'+c64 p99':>8} {'+paced p50':>10} {'+paced p99':>10} {'net+c1':>7} "
             f"{'net+pc50':>8} {'net+pc99':>8} {'req/s':>7} {'vs toy':>7} {'vs direct':>9} {'core busy':>9}"]
    for name, r in rows.items():
        lines.append(f"{name:<9} {r['c1']['p50_ms']:8.2f} {r['c1']['p99_ms']:8.2f} {r['c64']['p50_ms']:8.2f} "
                     f"{r['c64']['p99_ms']:8.2f} {added(r, 'c1', 'p50_ms'):8.2f} "
                     f"{added(r, 'c64', 'p50_ms'):8.2f} {added(r, 'c64', 'p99_ms'):8.2f} "
                     f"{added(r, 'c64paced', 'p50_ms'):10.2f} {added(r, 'c64paced', 'p99_ms'):10.2f} "
                     f"{added(r, 'c1', 'net_p50_ms'):7.2f} {added(r, 'c64paced', 'net_p50_ms'):8.2f} "
                     f"{added(r, 'c64paced', 'net_p99_ms'):8.2f} "
                     f"{r['rps']:7.0f} {r['rps'] / rows['toy']['rps']:7.2f} {r['rps'] / d['rps']:9.2f} "
                     f"{100 * r['core_busy']:8.0f}%")
    lines.append("times in ms to the last byte; '+' = added over direct; c64 = 64 streams with the upstream as fast "
                 f"as it can; paced = 64 streams, the upstream writing a token every {pace_ms:g} ms like an engine "
                 f"(direct: p50 {d['c64paced']['p50_ms']:.1f} ms); net+ = added over direct, each request's time "
                 "net of the upstream's own (c1 p50; paced p50, p99; direct's net paced p50/p99: "
                 f"{d['c64paced']['net_p50_ms']:.2f}/{d['c64paced']['net_p99_ms']:.2f} ms); req/s = streamed "
                 "requests per second with 64 streams, the proxy on one core; core busy = that proxy's CPU use "
                 "during the req/s run (direct: the upstream's)")
    return "\n".join(lines)


def _plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay bench router")

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(rows)
    for i, (key, label) in enumerate((("c1", "1 stream"), ("c64", "64 streams"), ("c64paced", "64 paced"))):
        a.bar([x + 0.27 * i for x in range(len(names))], [rows[n][key]["p50_ms"] for n in names], 0.27,
              label=f"p50, {label}")
    a.set_xticks([x + 0.27 for x in range(len(names))], names)
    a.set_yscale("log")
    a.set_ylabel("ms to last byte")
    a.legend()
    b.bar(names, [rows[n]["rps"] for n in names])
    b.set_ylabel("streamed requests / s (proxy on 1 core)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
