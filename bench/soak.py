"""`kvrelay bench soak`: mixed traffic for a long time while faults are injected on a schedule.

A 1P2D stack (and a third decode node held back for a ``decode added`` fault) with the store
on (CPU, a disk tier on a small filesystem of its own, Redis) serves a closed loop of
clients (:mod:`kvrelay.bench.soak_traffic`: greedy and sampled, streamed and not, clients that
hang up at random points and clients that stop reading). After a warm-up, one fault fires
every ``--fault-every`` seconds, the classes in turn (:mod:`kvrelay.bench.soak_faults`).

At the end it checks, and prints as a table (:mod:`kvrelay.bench.soak_report`):

* every greedy answer that completed equals one plain vLLM's (same dtype, one pinned thread
  like each engine), asked the same bodies before the stack starts;
* no request hangs past its client timeout, and none is lost without an error;
* every engine ends idle (no running or waiting request, no busy slot, receiver entry or transfer);
* the router's and the never-restarted engines' RSS and open descriptors grow under 10 %
  from the end of the warm-up to the end;

and the recovery matrix: per fault class, the requests in flight when it fired, how they
ended, the time until the fault was repaired and until the stack completed requests at its
warm-up rate again. ``--quick`` is the 5-minute variant CI runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.bench import report, soak_report, stack_flags
from kvrelay.bench.local_redis import REDIS, RedisServer
from kvrelay.bench.soak_faults import CYCLE, HELD, QUICK, Injection, Injector, schedule, small_filesystem
from kvrelay.bench.soak_traffic import End, Load, Mix, Outcome, Prompt, prompt_pool
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

IDLE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "kvrelay_pool_slots_busy",
               "kvrelay_receiver_entries", "kvrelay_transfers_inflight")
GROWTH_LIMIT = 0.10


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=3600.0, metavar="SECONDS", help="traffic time (default 3600)")
    p.add_argument("--warmup", type=float, default=180.0, metavar="SECONDS",
                   help="traffic before the first fault; the warm-up rate is measured here (default 180)")
    p.add_argument("--fault-every", type=float, default=240.0, metavar="SECONDS", help="seconds between faults (default 240)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="clients in the closed loop (default 8)")
    p.add_argument("--prompts", type=int, default=64, metavar="N", help="distinct prompts (default 64)")
    p.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS", help="a client's timeout (default 180)")
    p.add_argument("--hold", type=float, default=20.0, metavar="SECONDS",
                   help="how long Redis stays down and the disk stays full (default 20)")
    p.add_argument("--seed", type=int, default=0, metavar="N")
    p.add_argument("--base-port", type=int, default=26000, metavar="PORT")
    p.add_argument("--quick", action="store_true", help="the CI variant: 5 minutes, three faults")
    p.add_argument("--reference-url", action="append", default=[], metavar="URL",
                   help="a running plain vLLM server (the engines' model, dtype and one pinned thread, like each "
                        "engine) to take the reference answers from; repeatable (default: start two)")
    p.add_argument("--out", default="", metavar="DIR", help="where the table, JSON, PNG and logs go "
                   "(default bench-results/soak-<time>)")
    stack_flags.add_args(p)


def soak_config(args: argparse.Namespace, out: Path, redis_url: str, disk: Path | None) -> kcfg.KVRelayConfig:
    base = args.base_port
    data: dict[str, Any] = {
        "engine": {"served_model_name": launch.TINY_NAME, "max_model_len": 4096},
        "deploy": {"decode": 3, "base_port": base, "kv_base_port": base + 500, "log_dir": str(out / "logs")},
        "router": {"port": base + 50, "health_interval_s": 0.5, "stall_timeout_s": 10, "client_write_timeout_s": 5},
        "connector": {"events_path": "", "first_chunk_s": 20},
        "store": {"enabled": True, "cpu_bytes": "256MiB", "redis_url": redis_url,
                  "disk_path": str(disk or out / "disk"), "disk_bytes": "256MiB"},
    }
    return stack_flags.build(args, data)


def reference(cfg: kcfg.KVRelayConfig, pool: list[Prompt], out: Path) -> dict[int, str]:
    """Plain vLLM (the engines' dtype, bound as each engine is; one server per core share:
    :mod:`kvrelay.bench.reference`): each prompt's greedy answer."""
    from kvrelay.bench.reference import servers

    with servers(cfg, cfg.deploy.base_port + 90, out / "reference") as running:
        return answers(running.urls, pool)


def answers(urls: list[str], pool: list[Prompt]) -> dict[int, str]:
    """Each prompt's greedy answer from the plain vLLM servers at ``urls``, one at a time on each."""
    import json
    import urllib.request

    from kvrelay.bench.reference import spread

    def answer(url: str, p: Prompt) -> str:
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(p.body(launch.TINY_NAME)).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return "".join(c["text"] for c in json.loads(r.read())["choices"])

    return {p.index: text for p, text in zip(pool, spread(urls, pool, answer), strict=True)}


class Sampler:
    """RSS and descriptors of the router and each node, every ``every_s``, by process name."""

    def __init__(self, stack: launch.Stack) -> None:
        self.stack = stack
        self.rows: dict[str, list[tuple[float, int, int, int]]] = {}    # name -> (t, pid, rss KiB, fds)

    def sample(self, now: float) -> None:
        for name, proc in list(self.stack.procs.items()):
            if proc.poll() is None:
                rss, fds = soak_report.process_sample([proc.pid])
                self.rows.setdefault(name, []).append((now, proc.pid, rss, fds))

    def lifetimes(self) -> dict[str, list[tuple[float, int, int]]]:
        """Each process that lived from the first sample to the last (never restarted)."""
        out = {}
        for name, rows in self.rows.items():
            if len({pid for _, pid, _, _ in rows}) == 1 and name in self.stack.procs:
                out[name] = [(t, rss, fds) for t, _, rss, fds in rows]
        return out


async def drive(args: argparse.Namespace, stack: launch.Stack, injector: Injector, pool: list[Prompt],
                sampler: Sampler) -> tuple[list[Outcome], list[Injection], float, float]:
    """Traffic, the fault schedule and the sampler at once; (outcomes, injections, start, end)."""
    from kvrelay.common.optional import progress_bar

    clock = time.monotonic
    t0 = clock()
    deadline = t0 + args.duration
    url = f"http://127.0.0.1:{stack.cfg.router.port}"
    load = Load(url, launch.TINY_NAME, pool, Mix(), args.concurrency, args.timeout, args.seed, clock)
    plan = schedule(args.duration, args.warmup, args.fault_every, QUICK if args.quick else CYCLE)
    injections: list[Injection] = []
    bar = progress_bar(total=int(args.duration), desc="soak", unit="s")

    async def faults() -> None:
        for offset, kind in plan:
            await asyncio.sleep(max(0.0, t0 + offset - clock()))
            done = await asyncio.to_thread(injector.inject, kind)
            injections.append(done)
            bar.write(f"{kind.value}: {done.skipped or done.detail} ({done.repaired - done.at:.0f} s)")

    async def samples() -> None:
        await asyncio.sleep(max(0.0, args.warmup - 5))          # the first before the first fault
        while clock() < deadline:
            await asyncio.to_thread(sampler.sample, clock())
            await asyncio.sleep(min(30.0, max(0.0, deadline - clock())))
        await asyncio.to_thread(sampler.sample, clock())

    async def progress() -> None:
        while clock() < deadline:
            await asyncio.sleep(5)
            bar.n = int(min(args.duration, clock() - t0))
            bar.set_postfix(done=sum(o.end is End.COMPLETE for o in load.outcomes), faults=len(injections))
        bar.close()

    outcomes, *_ = await asyncio.gather(load.run(deadline), faults(), samples(), progress())
    return outcomes, injections, t0, clock()


def scrape(url: str) -> Iterable[Metric]:
    """The metric families ``url``'s ``/metrics`` serves (Prometheus text, parsed by its client)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return text_string_to_metric_families(text)


def idle_engines(stack: launch.Stack, timeout_s: float = 90.0) -> dict[str, float]:
    """Wait until every running node reports nothing in flight; the sums of :data:`IDLE_SERIES` then."""

    def busy() -> dict[str, float]:
        total = dict.fromkeys(IDLE_SERIES, 0.0)
        for spec in stack.specs:
            if spec.name not in stack.procs:
                continue
            for fam in scrape(stack.url(spec)):
                for s in fam.samples:
                    if s.name in total:
                        total[s.name] += s.value
        return total

    deadline = time.monotonic() + timeout_s
    while True:
        now = busy()
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def router_counters(stack: launch.Stack) -> dict[str, float]:
    """The router's migrations, failures, fallbacks and client errors, by family and cause."""
    out: dict[str, float] = {}
    for fam in scrape(f"http://127.0.0.1:{stack.cfg.router.port}"):
        if fam.name.startswith(("kvrelay_router_migrat", "kvrelay_router_request_failures", "kvrelay_router_breaker",
                                "kvrelay_router_fallbacks", "kvrelay_router_client_errors")):
            for s in fam.samples:
                if s.name.endswith("_total") and s.value:
                    cause = s.labels.get("cause") or s.labels.get("outcome") or ""
                    key = fam.name.removeprefix("kvrelay_router_") + (f"{{{cause}}}" if cause else "")
                    out[key] = out.get(key, 0.0) + s.value
    return out


def summarize(args: argparse.Namespace, outcomes: list[Outcome], injections: list[Injection], want: dict[int, str],
              t0: float, t1: float, sampler: Sampler, idle: dict[str, float]) -> dict:
    baseline = soak_report.rate(outcomes, t0 + args.warmup / 3, t0 + args.warmup)
    grow = soak_report.growth(sampler.lifetimes())
    ex = soak_report.exactness(outcomes, want)
    hung = sum(o.end is End.HUNG for o in outcomes)
    lost = sum(o.end is End.LOST for o in outcomes)
    checks = {"0 differences": ex["differences"] == 0, "0 hung": hung == 0, "0 lost": lost == 0,
              "engines idle": not any(idle.values()),
              "growth < 10 %": all(g["rss_growth"] < GROWTH_LIMIT and g["fd_growth"] < GROWTH_LIMIT
                                   for g in grow.values()) and "router" in grow}
    matrix = soak_report.recovery_matrix(outcomes, injections, want, baseline, t1)
    return {"duration_s": t1 - t0, "requests": len(outcomes), "concurrency": args.concurrency,
            "baseline_rps": baseline, "exactness": ex, "hung": hung, "lost": lost, "ends": soak_report.ends(outcomes),
            "matrix": [r.row() for r in matrix], "growth": grow, "idle": idle, "checks": checks,
            "injections": [{**i.__dict__, "kind": i.kind.value, "at": round(i.at - t0, 1),
                            "repaired": round(i.repaired - t0, 1)} for i in injections],
            "outcomes": [{**o.row(), "t0": round(o.t0 - t0, 2), "t1": round(o.t1 - t0, 2)} for o in outcomes]}


def plot(summary: dict, path: Path) -> None:
    from kvrelay.common.optional import pyplot

    plt = pyplot("the soak plot")
    ends = sorted(o["t1"] for o in summary["outcomes"] if o["end"] == End.COMPLETE.value)
    width = 10.0
    bins = [sum(1 for t in ends if k * width <= t < (k + 1) * width) / width
            for k in range(int(summary["duration_s"] // width) + 1)]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([k * width for k in range(len(bins))], bins, label="completed/s (10 s bins)")
    for i in summary["injections"]:
        if not i["skipped"]:
            ax.axvline(i["at"], color="red", alpha=0.4)
            ax.text(i["at"], max(bins or [1]) * 0.95, i["kind"], rotation=90, fontsize=7, va="top")
    ax.axhline(summary["baseline_rps"], color="gray", ls="--", label="warm-up rate")
    ax.set_xlabel("seconds")
    ax.set_ylabel("completed requests/s")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace, out: Path) -> dict:
    pool = prompt_pool(args.prompts, args.seed)
    with contextlib.ExitStack() as es:
        disk = es.enter_context(small_filesystem(out / "disk", 64))
        redis = RedisServer(out) if REDIS else None
        if redis is not None:
            redis.start()
            es.callback(redis.stop)
        cfg = soak_config(args, out, redis.url if redis else "", disk)
        want = answers(args.reference_url, pool) if args.reference_url else reference(cfg, pool, out)
        stack = launch.Stack(cfg)
        es.callback(stack.stop)
        stack.start(hold={HELD})
        injector = Injector(stack, redis, disk, args.hold)
        sampler = Sampler(stack)
        outcomes, injections, t0, t1 = asyncio.run(drive(args, stack, injector, pool, sampler))
        idle = idle_engines(stack)
        summary = summarize(args, outcomes, injections, want, t0, t1, sampler, idle)
        summary["router"] = router_counters(stack)
        return summary


def main(args: argparse.Namespace) -> int:
    if args.quick:     # faults at 60, 130 and 200 s: the last (a drain and a restart) ends inside the 300 s
        args.duration, args.warmup, args.fault_every = 300.0, 60.0, 70.0
    out = Path(args.out or f"bench-results/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    summary = run(args, out)
    report.write_report(out, soak_report.table(summary), ("soak.json", summary), ("soak.png", lambda p: plot(summary, p)))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_args(ap)
    sys.exit(main(ap.parse_args()))
