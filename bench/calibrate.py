"""`kvrelay calibrate`: measure ``router.disagg_min_tokens`` on the hardware at hand.

Decode-first routing (``router.decode_first``) sends a request to its decode node alone when
at most ``router.disagg_min_tokens`` prompt tokens are left to compute. Whether a prefill
node plus a push beats that depends on two costs, both measured here on a 1P1D stack started
from the configuration (its engines, model, transport and core binding):

* the new request's TTFT: through the prefill node and a push, against the decode node
  computing the prompt itself;
* what the other requests on the decode node pay meanwhile: ``--streams`` answers stream
  from it throughout, and their worst inter-token gap during the new request, above their
  median gap, is the stall that request caused (a prompt computed on D stalls every stream
  on D for about its whole prefill; a push costs D an install).

For a decode node serving others (``router.disagg_min_tokens``), D alone wins at a length
while its TTFT is no worse than P plus the push and the stall it causes stays within
``--itl-budget-ms`` (default: ``kvrelay bench serve``'s per-token SLO). For an idle decode
node (``router.disagg_min_tokens_idle``) there is no one to stall: D alone wins while its
TTFT is no worse. For each prompt length (fresh prompts: nothing cached) both paths run
``--reps`` times, alternating; each recommended value is the longest length up to which D
alone wins at every length measured (the crossover). It prints the table and the lines to
put in the config, and writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvrelay.bench.e2e import ALPHABET, _stream
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="64,128,256,384,512,768,1024,1536,2048",
                   help="prompt lengths in tokens (comma list)")
    p.add_argument("--reps", type=int, default=3, help="requests per length and path")
    p.add_argument("--streams", type=int, default=4, help="answers streaming from the decode node throughout")
    p.add_argument("--itl-budget-ms", type=float, default=30.0,
                   help="the longest stall of D's streams a prompt computed on D may cause (default: bench serve's "
                        "--slo-tpot-ms)")
    p.add_argument("--base-port", type=int, default=19700, help="first port of the stack it starts")
    p.add_argument("--out", default="bench_results")


class Streams:
    """``n`` endless answers from one engine, each token's arrival time recorded."""

    def __init__(self, url: str, n: int, prompt_tokens: int = 200) -> None:
        self.url, self.n, self.prompt_tokens = url, n, prompt_tokens
        self.arrivals: list[list[float]] = [[] for _ in range(n)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            body = {"model": launch.TINY_NAME, "prompt": _text(self.prompt_tokens, 10_000 * i + k),
                    "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                for raw in r:
                    if raw.startswith(b"data: {"):
                        self.arrivals[i].append(time.perf_counter())
                    if self._stop.is_set():
                        return

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        time.sleep(3.0)                          # every stream past its own prefill
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def median_gap(self, since: float) -> float:
        gaps = [b - a for ts in self.arrivals for a, b in zip(ts, ts[1:], strict=False) if a >= since]
        return statistics.median(gaps) if gaps else 0.0

    def worst_gap(self, start: float, end: float) -> float:
        """The longest wait of any stream for a token that arrived in [start, end + a median gap]."""
        worst = 0.0
        for ts in self.arrivals:
            for a, b in zip(ts, ts[1:], strict=False):
                if b >= start and a <= end:
                    worst = max(worst, b - max(a, start))
        return worst


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _measure(url: str, prompt: str, streams: Streams, base_gap: float) -> tuple[float, float]:
    """(TTFT, stall) of one 2-token request to ``url`` while the streams run."""
    t0 = time.perf_counter()
    ttft, _ = _stream(url, launch.TINY_NAME, prompt, 2)
    end = time.perf_counter()
    return ttft, max(0.0, streams.worst_gap(t0, end) - base_gap)


def d_alone_wins(row: dict[str, Any], budget_s: float) -> bool:
    return row["ttft_d"] <= row["ttft_pd"] and row["stall_d"] <= budget_s


def recommend(rows: list[dict[str, Any]], budget_s: float = float("inf")) -> tuple[int, bool]:
    """(the longest length up to which D alone wins at every length, whether P + push ever won)."""
    best = 0
    for row in sorted(rows, key=lambda r: r["tokens"]):
        if not d_alone_wins(row, budget_s):
            return best, True
        best = row["tokens"]
    return best, False


def _run(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    from tqdm import tqdm

    data = kcfg.to_dict(kcfg.config_from_args(args))
    data["deploy"].update(prefill=1, decode=1, base_port=args.base_port, kv_base_port=args.base_port + 500,
                          log_dir=str(out / "logs"))
    data["router"].update(port=args.base_port + 50, decode_first=True, disagg_min_tokens=0)    # always P + push
    stack = launch.Stack(kcfg.from_dict(data))
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    try:
        stack.start(progress=True)
        router = f"http://127.0.0.1:{stack.cfg.router.port}"
        d_url = stack.url(next(s for s in stack.specs if s.role is launch.Role.DECODE))
        _stream(router, launch.TINY_NAME, _text(300, 1), 2)           # first-request costs, off the clock
        _stream(d_url, launch.TINY_NAME, _text(300, 2), 2)
        with Streams(d_url, args.streams) as streams, tqdm(total=len(lengths) * args.reps * 2, unit="req",
                                                          desc="calibrate", file=sys.stderr) as bar:
            base_gap = streams.median_gap(time.perf_counter() - 2.0)
            for n in lengths:
                got: dict[str, list[tuple[float, float]]] = {"pd": [], "d": []}
                for rep in range(args.reps):
                    order = ("pd", "d") if rep % 2 == 0 else ("d", "pd")
                    for path in order:
                        prompt = _text(n, 1_000_000 + 1000 * n + 10 * rep + (path == "d"))
                        got[path].append(_measure(router if path == "pd" else d_url, prompt, streams, base_gap))
                        bar.update(1)
                        time.sleep(0.2)
                rows.append(_row(n, got, base_gap))
    finally:
        stack.stop()
    return rows


def _row(n: int, got: dict[str, list[tuple[float, float]]], base_gap: float) -> dict[str, Any]:
    med = {f"{k}_{path}": statistics.median(x[i] for x in got[path])
           for path in got for i, k in enumerate(("ttft", "stall"))}
    return {"tokens": n, **med, "ttft_ratio_pd_over_d": med["ttft_pd"] / med["ttft_d"], "base_gap": base_gap}


def main(args: argparse.Namespace) -> int:
    out = Path(args.out) / f"calibrate-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    rows = _run(args, out)
    budget = args.itl_budget_ms / 1e3
    value, crossed = recommend(rows, budget)
    idle, idle_crossed = recommend(rows)
    lines = [f"{'tokens':>6} {'TTFT P+push ms':>14} {'TTFT D ms':>9} {'P+push / D':>10} {'stall P+push ms':>15} "
             f"{'stall D ms':>10} {'D alone wins':>12}"]
    for r in rows:
        lines.append(f"{r['tokens']:>6} {1e3 * r['ttft_pd']:>14.1f} {1e3 * r['ttft_d']:>9.1f} "
                     f"{r['ttft_ratio_pd_over_d']:>10.2f} {1e3 * r['stall_pd']:>15.1f} {1e3 * r['stall_d']:>10.1f} "
                     f"{'yes' if d_alone_wins(r, budget) else 'no':>12}")
    lines.append(f"stall: the worst token gap of {args.streams} streams on D above their median "
                 f"({1e3 * rows[0]['base_gap']:.1f} ms); D alone wins while its TTFT <= P+push's and its stall <= "
                 f"{args.itl_budget_ms:g} ms" if rows else "no rows")
    why = ("P + push wins from the next length on" if crossed
           else "D alone won at every length measured; measure longer prompts to find where P + push wins")
    lines.append(f"recommended: router.disagg_min_tokens: {value}   ({why})")
    lines.append(f"recommended: router.disagg_min_tokens_idle: {idle}   (" + (
        "P + push answers faster from the next length on)" if idle_crossed else
        "D alone answered no slower at every length measured)"))
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    (out / "calibrate.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                                    "rows": rows, "disagg_min_tokens": value, "crossed": crossed,
                                                    "disagg_min_tokens_idle": idle, "idle_crossed": idle_crossed},
                                                   indent=2, default=str))
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay calibrate")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] for r in rows], [1e3 * r["stall_d"] for r in rows], marker="o", label="stall, D alone")
    ax.plot([r["tokens"] for r in rows], [1e3 * r["stall_pd"] for r in rows], marker="o", label="stall, P + push")
    ax.plot([r["tokens"] for r in rows], [1e3 * (r["ttft_pd"] - r["ttft_d"]) for r in rows], marker="s",
            label="TTFT P + push - D alone")
    ax.axhline(args.itl_budget_ms, color="grey", lw=0.8, label="ITL budget")
    ax.axvline(value, color="tab:red", lw=0.8, ls="--", label=f"disagg_min_tokens = {value}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "calibrate.png", dpi=120)
    print(f"wrote {out}/calibrate.json, table.txt, calibrate.png", file=sys.stderr)
    return 0
