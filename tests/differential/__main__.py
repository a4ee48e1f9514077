"""``python -m tests.differential --n N --seed S``: a differential sweep, kvrelay against one vLLM.

Starts one plain vLLM (the reference), asks it N generated requests, then for each backend
a 1P1D kvrelay stack with both ``router.first_token`` modes, asks each the same requests,
and prints every difference with the request that caused it. ``--busy`` adds a stack whose
prefill node has a small KV cache and token budget, asked with bursts of concurrent
requests, and reports vLLM's own preemption count on it. ``--config NAME[,NAME]`` (or ``all``)
runs the engine-configuration axis instead (:mod:`tests.differential.configs`): per
configuration, a reference and a 1P2D stack with its flags, every path, one line of JSON.
Exit status 1 if any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.deploy.tiny_model import ensure_tiny_model
from tests.differential import run
from tests.differential.surface import Surface
from tests.e2e.harness import DECODE_FIRST, _cfg, start_stack, stop_active


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="requests to generate (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    ap.add_argument("--backends", default="tcp,nixl", help="comma-separated transports (default tcp,nixl)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight against kvrelay (default 4)")
    ap.add_argument("--ref-concurrency", type=int, default=1,
                    help="unseeded requests in flight against the reference (default 1; seeded ones always go one "
                         "at a time; more is faster and can only add differences, never hide one: the "
                         "reference runs no kvrelay code)")
    ap.add_argument("--busy", action="store_true", help="also a busy prefill node (preempting), reported")
    ap.add_argument("--workdir", default="", help="where logs go (default: a new temporary directory)")
    ap.add_argument("--json", default="", help="write the summary and every difference here")
    ap.add_argument("--config", default="", help="engine configurations to sweep instead (comma-separated "
                    "names from tests/differential/configs.py, or 'all')")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvrelay-diff-"))
    if args.config:
        return sweep_configs(args.config, args.n, args.seed, work, args.json)
    model = ensure_tiny_model(work / "model")
    reqs = Surface(args.seed).draw(args.n)
    t0 = time.monotonic()
    want = run.reference_answers(_cfg(model, work / "ref", 18790), reqs, 18790, work / "ref", args.ref_concurrency)
    print(f"reference: {len(reqs)} requests in {time.monotonic() - t0:.0f} s", flush=True)
    diffs, rows = [], []
    targets = [(b, False) for b in args.backends.split(",")] + ([("tcp", True)] if args.busy else [])
    for i, (backend, busy) in enumerate(targets):
        over = {"transport__backend": backend, **DECODE_FIRST}
        if busy:
            over["engine__prefill_args"] = run.busy_prefill_args()
        handle = start_stack(model, work / f"stack-{i}", 18400 + 100 * i, **over)
        routers, proc = run.routers_of(handle.stack, handle.cfg.router.port + 1)
        try:
            p_url = handle.stack.url(next(s for s in handle.stack.specs if s.role.value == "prefill"))
            for mode, url in sorted(routers.items()):
                t1, target = time.monotonic(), f"{backend}{'-busy' if busy else ''}/{mode}"
                asked = [i for i, r in enumerate(reqs) if not (busy and "seed" in r.body)]   # see test_differential
                with run.Decoders(p_url) if busy else contextlib.nullcontext():
                    have = run.ask(url, [reqs[i] for i in asked], 16 if busy else args.concurrency, target)
                found = run.compare([reqs[i] for i in asked], [want[i] for i in asked], have, target)
                diffs += found
                rows.append({"target": target, "busy": busy,
                             "requests": len(reqs), "differences": len(found),
                             "seconds": round(time.monotonic() - t1, 1), "preemptions": run.preemptions(p_url)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            run.launch.stop_group(proc)
            stop_active()
    for d in diffs:
        print(d)
    total = time.monotonic() - t0
    print(f"\n{len(diffs)} differences in {len(reqs)} requests x {len(rows)} targets; seed {args.seed}; "
          f"wall time {total:.0f} s (logs in {work})")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "n": args.n, "wall_s": round(total, 1),
                                               "targets": rows, "differences": [str(d) for d in diffs]}, indent=2))
    return 1 if diffs else 0


def sweep_configs(names: str, n: int, seed: int, work: Path, json_path: str) -> int:
    """The engine-configuration axis: one JSON line per configuration, then the differences."""
    from tests.differential.configs import BY_NAME, CASES, run_case

    cases = list(CASES) if names == "all" else [BY_NAME[name] for name in names.split(",")]
    rows, diffs = [], []
    try:
        for case in cases:
            out = run_case(case, n, seed, work / case.name)
            diffs += out.differences
            rows.append({"config": case.name, "requests": out.requests, "differences": len(out.differences),
                         "store_loads": out.store_hits, "migrated": out.migrated, "wall_s": out.wall_s,
                         "targets": out.rows})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_active()                  # run_case retires each stack: wait for the last one to be gone
    for d in diffs:
        print(d)
    print(f"\n{len(diffs)} differences over {len(cases)} configurations; seed {seed}; logs in {work}")
    if json_path:
        Path(json_path).write_text(json.dumps({"seed": seed, "n": n, "configs": rows,
                                               "differences": [str(d) for d in diffs]}, indent=2))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
