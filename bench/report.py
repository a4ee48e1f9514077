"""What a benchmark leaves behind: a table printed and saved, its figures as JSON, a PNG.

:func:`write_report` is shared by every harness; :func:`e2e_table` and :func:`ttft_plot`
render ``kvrelay bench e2e``'s rows (each figure also as a ratio against a peer measured
in the same run: these machines are noisy).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def e2e_table(rows: list[dict], transfer: dict[str, dict], interleaved: bool) -> str:
    single = {r["prompt_tokens"]: r["ttft_ms"] for r in rows if r["system"] == "single"}
    single_p = {r["prompt_tokens"]: r["ttft_ms"] for r in rows if r["system"] == "single-p"}
    fair = {r["prompt_tokens"]: r["ttft_ms"] for r in rows if r["system"] == "nixl-fair"}
    fair_total = {r["prompt_tokens"]: r["total_ms"] for r in rows if r["system"] == "nixl-fair"}
    nan = float("nan")
    lines = [f"{'system':<14} {'tokens':>6} {'TTFT ms':>9} {'p90/p50':>7} {'ITL ms':>7} {'TTFT/single':>11} "
             f"{'TTFT/single-p':>13} {'TTFT/nixl-fair':>14} {'paired/sp':>9} {'paired/fair':>11} "
             f"{'total ms':>9} {'total/fair':>10} {'exposed ms':>10} {'exposed/chunk':>13}"]
    for r in rows:
        n = r["prompt_tokens"]
        x = transfer.get(r["system"], {})
        exp = x.get("exposed_ms", {}).get(n)
        chunk = x.get("one_chunk_ms")
        lines.append(f"{r['system']:<14} {n:>6} {r['ttft_ms']:>9.1f} {r['ttft_p90_ms'] / r['ttft_ms']:>7.2f} "
                     f"{r['itl_ms']:>7.2f} "
                     f"{r['ttft_ms'] / single[n] if n in single else nan:>11.2f} "
                     f"{r['ttft_ms'] / single_p[n] if n in single_p else nan:>13.2f} "
                     f"{r['ttft_ms'] / fair[n] if n in fair else nan:>14.2f} "
                     f"{r['paired_vs_single_p']:>9.2f} {r['paired_vs_nixl_fair']:>11.2f} "
                     f"{r['total_ms']:>9.1f} {r['total_ms'] / fair_total[n] if n in fair_total else nan:>10.2f} "
                     f"{exp if exp is not None else nan:>10.1f} "
                     f"{exp / chunk if exp is not None and chunk else nan:>13.2f}")
    for name, x in transfer.items():
        lines.append(f"{name}: one chunk's transfer (push start -> installed) = {x['one_chunk_ms']:.2f} ms")
    lines.append("medians over the requests of each length; total = request sent -> last of the answer's tokens")
    lines.append("paired/sp, paired/fair: median over rounds of TTFT / the same prompt's TTFT on single-p, "
                 "nixl-fair" + (" (interleaved: the same round, back to back)" if interleaved
                                else " (sequential: systems measured minutes apart)"))
    return "\n".join(lines)


def write_report(out: Path, text: str, data: tuple[str, dict[str, Any]],
                 plot: tuple[str, Callable[[Path], None]]) -> None:
    """What a benchmark leaves behind: the table printed and in ``table.txt``, ``data`` (file name,
    figures) as JSON, and ``plot`` (file name, ``draw(path)``) as a PNG."""
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / data[0]).write_text(json.dumps(data[1], indent=2, default=str))
    plot[1](out / plot[0])
    print(f"wrote {out}/{data[0]}, table.txt, {plot[0]}", file=sys.stderr)


def ttft_plot(rows: list[dict], path: Path) -> None:
    from kvrelay.common.optional import pyplot

    plt = pyplot("the benchmark plot")

    fig, ax = plt.subplots(figsize=(7, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if r["system"] == system]
        ax.plot(*zip(*pts, strict=True), marker="o", label=system)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
