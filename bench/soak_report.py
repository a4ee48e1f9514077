"""What a soak proves, from its outcomes, its injections and its resource samples.

* :func:`exactness`: every greedy answer that completed equals the reference's;
* :func:`recovery_matrix`: per fault class, the requests in flight when it was injected and
  how they ended (exact, different, told, lost, hung), the time until the fault was repaired
  and the time until the stack completed requests at its warm-up rate again;
* :func:`growth`: RSS and open descriptors of each long-lived process, warm-up to end;
* :func:`table`: all of it as text.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench.soak_faults import FaultKind, Injection
from kvrelay.bench.soak_traffic import End, Kind, Outcome

RATE_WINDOW_S = 20.0          # completions are counted over windows this long
FULL_RATE = 0.9               # "served at full rate again": a window at >= 90 % of the warm-up rate


def exact(o: Outcome, want: dict[int, str]) -> bool | None:
    """A completed greedy answer equal to the reference's (None: nothing to compare)."""
    if o.kind is not Kind.GREEDY or o.end is not End.COMPLETE:
        return None
    return o.text == want[o.prompt]


def exactness(outcomes: list[Outcome], want: dict[int, str]) -> dict:
    verdicts = [exact(o, want) for o in outcomes]
    wrong = [o for o, v in zip(outcomes, verdicts, strict=True) if v is False]
    return {"greedy_completed": sum(v is not None for v in verdicts), "differences": len(wrong),
            "examples": [{"prompt": o.prompt, "stream": o.stream, "got": o.text[:120], "want": want[o.prompt][:120]}
                         for o in wrong[:5]]}


def ends(outcomes: Iterable[Outcome]) -> dict[str, int]:
    return dict(Counter(f"{o.kind.value}/{o.end.value}" for o in outcomes))


def rate(outcomes: list[Outcome], start: float, end: float) -> float:
    """Completed requests per second that ended in [start, end)."""
    done = sum(1 for o in outcomes if o.end is End.COMPLETE and start <= o.t1 < end)
    return done / max(end - start, 1e-9)


def recovered_after(outcomes: list[Outcome], at: float, baseline: float, until: float) -> float | None:
    """Seconds from ``at`` until a window of :data:`RATE_WINDOW_S` completes at full rate (None: not before ``until``)."""
    t = at
    while t + RATE_WINDOW_S <= until:
        if rate(outcomes, t, t + RATE_WINDOW_S) >= FULL_RATE * baseline:
            return round(t - at, 1)
        t += 2.0
    return None


@dataclass(frozen=True)
class MatrixRow:
    kind: FaultKind
    injected: int
    in_flight: int
    completed: int               # greedy ones equal to one vLLM's, and sampled ones
    different: int               # greedy answers that completed different from one vLLM's
    told: int
    lost: int
    hung: int
    repaired_s: list[float]
    full_rate_s: list[float | None]
    skipped: str = ""

    def row(self) -> dict:
        return {k: (v.value if isinstance(v, FaultKind) else v) for k, v in self.__dict__.items()}


def recovery_matrix(outcomes: list[Outcome], injections: list[Injection], want: dict[int, str],
                    baseline: float, end: float) -> list[MatrixRow]:
    rows = []
    for kind in FaultKind:
        mine = [i for i in injections if i.kind is kind and not i.skipped]
        skipped = next((i.skipped for i in injections if i.kind is kind and i.skipped), "")
        if not mine and not skipped:
            continue
        flight = [o for i in mine for o in outcomes
                  if o.t0 <= i.at < (o.t1 or end) and o.kind in (Kind.GREEDY, Kind.SAMPLED)]
        c = Counter(o.end for o in flight)
        verdicts = [exact(o, want) for o in flight]
        nexts = [min([j.at for j in injections if j.at > i.at] + [end]) for i in mine]
        rows.append(MatrixRow(kind, len(mine), len(flight),
                              sum(1 for o, v in zip(flight, verdicts, strict=True) if o.end is End.COMPLETE and v is not False),
                              verdicts.count(False), c[End.TOLD], c[End.LOST], c[End.HUNG],
                              [round(i.repaired - i.at, 1) for i in mine],
                              [recovered_after(outcomes, i.at, baseline, n) for i, n in zip(mine, nexts, strict=True)],
                              "" if mine else skipped))
    return rows


def process_sample(pids: Iterable[int]) -> tuple[int, int]:
    """(RSS KiB, open descriptors) summed over ``pids`` and their process groups' members."""
    groups = {os.getpgid(p) for p in pids if Path(f"/proc/{p}").exists()}
    rss = fds = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) not in groups:
                continue
            status = (entry / "status").read_text()
            rss += next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
            fds += len(os.listdir(entry / "fd"))
        except (OSError, StopIteration, ProcessLookupError):
            continue                                  # it exited meanwhile, or a kernel thread (no VmRSS)
    return rss, fds


def growth(samples: dict[str, list[tuple[float, int, int]]]) -> dict[str, dict]:
    """Per process: RSS and descriptors at the end of warm-up (the first sample) and at the end."""
    out = {}
    for name, rows in samples.items():
        if len(rows) < 2:
            continue
        (_, rss0, fd0), (_, rss1, fd1) = rows[0], rows[-1]
        out[name] = {"rss_kib": [rss0, rss1], "rss_growth": round(rss1 / max(rss0, 1) - 1, 3),
                     "fds": [fd0, fd1], "fd_growth": round(fd1 / max(fd0, 1) - 1, 3)}
    return out


def table(summary: dict) -> str:
    ex, m = summary["exactness"], summary["matrix"]
    lines = [f"soak: {summary['duration_s']:.0f} s of traffic, {summary['requests']} requests, "
             f"{summary['concurrency']} clients; warm-up rate {summary['baseline_rps']:.2f} completed/s",
             f"greedy answers completed: {ex['greedy_completed']}, different from one vLLM: {ex['differences']}",
             f"hung past the client timeout: {summary['hung']}; lost without an error: {summary['lost']}",
             "", f"{'fault':<17} {'n':>2} {'in flight':>9} {'done':>5} {'diff':>4} {'told':>4} {'lost':>4} "
             f"{'hung':>4}  {'repaired s':<18} {'full rate after s':<18}"]
    for r in m:
        if r["skipped"]:
            lines.append(f"{r['kind']:<17} not run: {r['skipped']}")
            continue
        lines.append(f"{r['kind']:<17} {r['injected']:>2} {r['in_flight']:>9} {r['completed']:>5} {r['different']:>4} "
                     f"{r['told']:>4} {r['lost']:>4} {r['hung']:>4}  {_list(r['repaired_s']):<18} "
                     f"{_list(r['full_rate_s']):<18}")
    lines += ["", "in flight: greedy and sampled requests open when the fault fired; done: completed (greedy ones equal "
              "to one vLLM's), diff: greedy ones that completed different; told: an HTTP error or error event",
              "full rate: a 20 s window completing >= 90 % of the warm-up rate; '-': not before the next fault",
              "", f"{'process':<10} {'RSS MiB start':>13} {'end':>7} {'growth':>7} {'fds start':>9} {'end':>5} {'growth':>7}"]
    for name, g in summary["growth"].items():
        lines.append(f"{name:<10} {g['rss_kib'][0] / 1024:>13.0f} {g['rss_kib'][1] / 1024:>7.0f} {g['rss_growth']:>7.1%} "
                     f"{g['fds'][0]:>9} {g['fds'][1]:>5} {g['fd_growth']:>7.1%}")
    lines += ["", "router: " + ", ".join(f"{k} {v:g}" for k, v in summary.get("router", {}).items()),
              "ends: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["ends"].items()))]
    lines += ["", "engines at the end: " + ", ".join(f"{k} {v:g}" for k, v in summary["idle"].items()),
              "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in summary["checks"].items())]
    return "\n".join(lines)


def _list(xs: list) -> str:
    return ",".join("-" if x is None else f"{x:g}" for x in xs)
