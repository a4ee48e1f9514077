"""`kvrelay bench breakdown`: where kvrelay's first token spends its time over one vLLM's.

kvrelay's TTFT (``router.first_token: prefill``) is the prefill node's answer to a
one-token request, passed through the router. This harness takes that path apart, one
piece added per step, against a plain vLLM on the prefill node's cores (``single-p``):

* ``single-p``  - a plain vLLM (no connector), the prompt streamed, one token;
* ``P plain``   - kvrelay's prefill node, the same request (the connector loaded, idle);
* ``P split``   - the request the router sends P (not streamed, token ids returned), no push;
* ``P push``    - the same with signed push params: P pushes the prompt's chunks to D while
                  it answers (D's continuation follows, untimed, so D's slots are freed);
* ``router``    - the whole path: the router, P, the push, token 1 streamed to the client.

Every round sends each step a fresh prompt of the same length (so no step profits from
another's prefix cache), in an order that rotates from round to round; each figure is the
median of paired differences against ``single-p`` in the same round, because this host's
speed drifts by 2x within minutes. Writes ``breakdown.json``, ``table.txt`` and
``breakdown.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvrelay.bench import e2e, report, stack_flags
from kvrelay.common.secrets import SECRET_ENV, generate_secret, load_secret
from kvrelay.core.params import ParamsSigner, PullParams, PushParams, params_dict
from kvrelay.deploy import launch
from kvrelay.router import split

STEPS = ("single-p", "P plain", "P split", "P push", "router")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="240,1024", help="prompt lengths (comma list)")
    p.add_argument("--reps", type=int, default=30, help="rounds per length")
    p.add_argument("--backend", default="tcp", help="kvrelay transport")
    p.add_argument("--base-port", type=int, default=21000,
                   help="first port: single-p uses base + 90, the 1P1D stack the 1,000 ports from base + 1000")
    p.add_argument("--out", default="bench_results", help="directory for the JSON, table and PNG")
    stack_flags.add_args(p)


def _timed_post(url: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    answer = e2e._post(url, body)
    return time.perf_counter() - t0, answer


class Steps:
    """The five ways to get one token (see the module docstring); each returns seconds."""

    def __init__(self, sp: str, p: str, d: str, router: str, d_kv: str, signer: ParamsSigner) -> None:
        self.sp, self.p, self.d, self.router, self.d_kv, self.signer = sp, p, d, router, d_kv, signer

    def _client_body(self, prompt: str) -> dict:
        return {"model": launch.TINY_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    def single_p(self, prompt: str) -> float:
        return e2e._stream(self.sp, launch.TINY_NAME, prompt, 1)[0]

    def p_plain(self, prompt: str) -> float:
        return e2e._stream(self.p, launch.TINY_NAME, prompt, 1)[0]

    def p_split(self, prompt: str) -> float:
        return _timed_post(f"{self.p}/v1/completions", split.prefill_body(self._client_body(prompt)))[0]

    def p_push(self, prompt: str) -> float:
        tid = uuid.uuid4().hex
        body = split.prefill_body(self._client_body(prompt))
        body["kv_transfer_params"] = params_dict(self.signer.sign(PushParams(transfer_id=tid, push_to=self.d_kv,
                                                                               early=True)))
        took, answer = _timed_post(f"{self.p}/v1/completions", body)
        first = split.FirstToken.parse("/v1/completions", answer)       # D takes the pushed chunks (untimed)
        dbody = split.decode_body(self._client_body(prompt), first, 32)
        dbody["kv_transfer_params"] = params_dict(self.signer.sign(PullParams(transfer_id=tid,
                                                                              tail=len(first.token_ids))))
        e2e._stream(self.d, launch.TINY_NAME, dbody.pop("prompt"), dbody.pop("max_tokens"),
                    extra={k: v for k, v in dbody.items() if k != "model"})
        return took

    def routed(self, prompt: str) -> float:
        return e2e._stream(self.router, launch.TINY_NAME, prompt, 32)[0]

    def table(self) -> dict[str, Callable[[str], float]]:
        return dict(zip(STEPS, (self.single_p, self.p_plain, self.p_split, self.p_push, self.routed), strict=True))


def measure(steps: dict[str, Callable[[str], float]], n: int, reps: int, bar: object) -> dict[str, list[float]]:
    """``reps`` rounds at ``n`` prompt tokens: every step once per round, the order rotating."""
    took: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(reps):
        for name in e2e.rotation(list(steps), rep):
            prompt = e2e._prompt(n, 100_000 * n + 10 * rep + STEPS.index(name))   # fresh: no prefix hits
            took[name].append(steps[name](prompt))
            time.sleep(0.05)
            bar.update(1)       # type: ignore[attr-defined]
    return took


def summarize(took: dict[str, list[float]]) -> list[dict]:
    """Per step: median, and medians of the paired differences to single-p and to the previous step."""
    rows, prev = [], None
    base = took["single-p"]
    for name, v in took.items():
        row = {"step": name, "p50_ms": 1e3 * statistics.median(v),
               "vs_single_p_ms": 1e3 * statistics.median([a - b for a, b in zip(v, base, strict=True)]),
               "vs_single_p": statistics.median([a / b for a, b in zip(v, base, strict=True)]),
               "added_ms": 1e3 * statistics.median([a - b for a, b in zip(v, took[prev], strict=True)])
               if prev else 0.0}
        rows.append(row)
        prev = name
    return rows


def _plot(results: dict[int, list[dict]], path: Path) -> None:
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay bench breakdown")

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(results)
    for k, (n, rows) in enumerate(results.items()):
        ax.bar([i + k * width for i in range(len(rows))], [r["vs_single_p_ms"] for r in rows], width,
               label=f"{n} tokens")
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(STEPS))], STEPS)
    ax.set_ylabel("TTFT over single-p, ms (paired median)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _report(results: dict[int, list[dict]]) -> str:
    lines = [f"{'tokens':>6} {'step':<9} {'TTFT p50 ms':>11} {'vs single-p ms':>14} {'ratio':>6} {'this step adds ms':>17}"]
    for n, rows in results.items():
        lines += [f"{n:>6} {r['step']:<9} {r['p50_ms']:>11.1f} {r['vs_single_p_ms']:>+14.1f} {r['vs_single_p']:>6.2f} "
                  f"{r['added_ms']:>+17.1f}" for r in rows]
    lines.append("paired medians over rounds (same round, back to back); each step adds one piece of kvrelay's path")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    lengths = [int(t) for t in args.tokens.split(",")]
    out = Path(args.out) / f"breakdown-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(SECRET_ENV, generate_secret())      # this harness signs P's params like the router
    e2e_args = argparse.Namespace(max_tokens=32, prefill_batch_tokens=0, base_port=args.base_port)
    sp = e2e.up_single(e2e_args, out, "single-p", args.base_port)
    try:
        kv = e2e.up_kvrelay(e2e_args, out, args.backend, "prefill", args.base_port + 1000)
    except BaseException:
        sp.stop()
        raise
    results: dict[int, list[dict]] = {}
    try:
        cfg = kv.cfg
        assert cfg is not None
        host, port = f"http://{cfg.deploy.host}", cfg.deploy.base_port          # P, then D (a 1P1D stack)
        steps = Steps(sp.url, f"{host}:{port}", f"{host}:{port + 1}", kv.url,
                      f"tcp://{cfg.deploy.host}:{cfg.deploy.kv_base_port}",
                      ParamsSigner(load_secret(cfg.transport), 60.0))
        bar = tqdm(total=len(lengths) * args.reps * len(STEPS), desc="bench breakdown", unit="req")
        for n in lengths:
            results[n] = summarize(measure(steps.table(), n, args.reps, bar))
        bar.close()
    finally:
        kv.stop()
        sp.stop()
    report.write_report(out, _report(results),
                     ("breakdown.json", {"args": {k: v for k, v in vars(args).items() if k != "func"},
                                         "results": results}),
                     ("breakdown.png", lambda path: _plot(results, path)))
    return 0
