"""Path by path, how far kvrelay's numbers are from one vLLM's: greedy logprobs compared bit for bit.

The differential harness compares answers; a near-tie flips an answer only now and then. This
compares the numbers under them. The drawn requests of a configuration (``--config``), made
greedy with 16 tokens and the top-5 logprobs of each, are asked of one plain vLLM twice (cold,
then warm: each prompt's whole blocks in its prefix cache) and of a 1P2D kvrelay stack through
its paths: round 1 with every token from D, then token 1 from P, then round 2 (every repeated
prompt a store hit). Each comparison prints how many answers have every logprob equal to the
bit, and for the others the first position that differs, the largest difference there and the
first position where the chosen token differs.

    python -m tests.differential.logprob_paths --config bf16 --n 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvrelay.bench.reference import servers
from kvrelay.deploy import launch
from kvrelay.deploy.tiny_model import ensure_tiny_model
from tests.differential import run
from tests.differential.compare import Answer
from tests.differential.configs import BY_NAME, REF_PORT, STACK_PORT, cfg_for, engine_args, requests_for
from tests.differential.surface import Request
from tests.e2e.harness import DECODE_FIRST, retire, start_stack, stop_active

Row = tuple[str, tuple[tuple[str, float], ...]]       # (chosen token, its top-5 (token, logprob))


def greedy_with_logprobs(drawn: list[Request]) -> list[Request]:
    """The text and chat requests among ``drawn``, greedy, 16 tokens, top-5 logprobs each."""
    out: list[Request] = []
    for r in drawn:
        b = {k: v for k, v in r.body.items() if k in ("model", "prompt", "messages")}
        chat = r.path.endswith("chat/completions")
        if not chat and not isinstance(b.get("prompt"), str):
            continue
        b.update(temperature=0, max_tokens=16, **({"logprobs": True, "top_logprobs": 5} if chat else {"logprobs": 5}))
        out.append(Request(len(out), r.path, b, {}))
    return out


def rows(answer: Answer) -> list[Row]:
    lp = json.loads(answer.body)["choices"][0]["logprobs"]
    if "content" in lp:                                    # chat
        return [(t["token"], tuple((x["token"], x["logprob"]) for x in t["top_logprobs"])) for t in lp["content"]]
    return [(tok, tuple(sorted(top.items()))) for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]


def compare(name: str, want: list[Answer], have: list[Answer]) -> dict:
    """Print and return how ``have`` differs from ``want``, answer by answer."""
    exact, moved, lines = 0, 0, []
    for i, (w, h) in enumerate(zip(want, have, strict=True)):
        a, b = rows(w), rows(h)
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        token = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0]), None)
        exact += first is None
        moved += token is not None
        if first is not None:
            x, y = dict(a[first][1]), dict(b[first][1])
            d = max((abs(x[k] - y[k]) for k in x.keys() & y.keys()), default=float("nan"))
            lines.append(f"  #{i}: logprobs differ from token {first} (largest |d| {d:.2e}); answer differs from {token}")
    print(f"{name}: {exact}/{len(want)} answers with every logprob equal to the bit, {moved} with another token")
    print("\n".join(lines))
    return {"name": name, "bitwise": exact, "answers": len(want), "other_token": moved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bf16", choices=sorted(BY_NAME))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("--workdir", default="/tmp/kvrelay-logprob-paths")
    args = ap.parse_args()
    case, work = BY_NAME[args.config], Path(args.workdir)
    model = ensure_tiny_model(work / f"model-{case.attention}", attention=case.attention)
    reqs = greedy_with_logprobs(requests_for(case, args.n, args.seed, model))
    with servers(cfg_for(case, model, work / "ref", REF_PORT), REF_PORT, work / "ref", startup_s=900) as ref:
        cold = run.answers_from(ref.urls, reqs)
        warm = run.answers_from(ref.urls, reqs)
    compare("one vLLM, asked again, against its first answers", cold, warm)
    handle = start_stack(model, work / "stack", STACK_PORT, transport__backend="tcp", deploy__decode=2,
                         store__enabled=True, store__cpu_bytes="1GiB", engine__extra_args=engine_args(case, work),
                         engine__max_model_len=case.max_model_len, engine__prefill_args=["--no-enable-prefix-caching"],
                         router__first_token="decode", **DECODE_FIRST)
    try:
        routers, proc = run.routers_of(handle.stack, handle.cfg.router.port + 1, True)
        compare("kvrelay round 1, every token from D, against one vLLM's first answers", cold,
                run.ask(routers["decode"], reqs, 1, "round 1"))
        compare("kvrelay, token 1 from P (a repeat: store hits), against one vLLM's first answers", cold,
                run.ask(routers["prefill"], reqs, 1, "token 1 from P"))
        again = run.ask(routers["decode"], reqs, 1, "round 2")
        compare("kvrelay round 2 (store hits) against one vLLM's first answers", cold, again)
        compare("kvrelay round 2 (store hits) against one vLLM's answers when asked again", warm, again)
        if proc is not None:
            launch.stop_group(proc)
    finally:
        retire(handle.stack)
        stop_active()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
