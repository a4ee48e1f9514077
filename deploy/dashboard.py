"""`kvrelay dashboard`: the Grafana dashboard's panels as one PNG, from a real Prometheus.

Reads ``deploy/monitoring/dashboard.json`` (the dashboard Grafana imports), runs every
panel's PromQL through Prometheus's HTTP API (``/api/v1/query_range``) over the last
``--minutes``, and plots each panel with matplotlib, legends from the panels'
``legendFormat``. For hosts without Grafana, and for checking that every panel's query
returns data on a live deployment (a panel with no series says so in its title).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from kvrelay.common.errors import UnreachableError

DASHBOARD = Path(__file__).parent / "monitoring" / "dashboard.json"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    p.add_argument("--dashboard", default=str(DASHBOARD), help="Grafana dashboard JSON")
    p.add_argument("--minutes", type=float, default=15.0, help="time range, ending now")
    p.add_argument("--out", default="kvrelay-dashboard.png")


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """Prometheus ``query_range``: [{'metric': {...}, 'values': [[t, 'v'], ...]}, ...]; raises on an error."""
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{prom}/api/v1/query_range?{q}", timeout=30) as r:
            body = json.loads(r.read())
    except (OSError, ValueError) as exc:          # URLError, refused, timed out, not JSON
        raise UnreachableError(f"Prometheus at {prom} did not answer a query: {exc}") from exc
    if body.get("status") != "success":
        raise UnreachableError(f"Prometheus at {prom} refused {expr!r}: {body.get('error')}")
    return list(body["data"]["result"])


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def with_variables(expr: str, variables: dict[str, str]) -> str:
    """Grafana's ``$name`` template variables replaced by their values (``.*``: all)."""
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), expr)


def panel_series(prom: str, panel: dict[str, Any], start: float, end: float, step: float,
                 variables: dict[str, str] | None = None) -> list[tuple[str, list[float], list[float]]]:
    out = []
    for target in panel.get("targets", []):
        for s in query_range(prom, with_variables(target["expr"], variables or {}), start, end, step):
            ts = [float(t) - end for t, _ in s["values"]]
            vs = [float(v) if v not in ("NaN", "+Inf", "-Inf") else math.nan for _, v in s["values"]]
            out.append((legend(target.get("legendFormat", ""), s["metric"]), ts, vs))
    return out


def render(prom: str, dashboard: Path, minutes: float, out: Path) -> dict[str, int]:
    """Plot every panel; returns {panel title: number of series}."""
    from kvrelay.common.optional import pyplot

    plt = pyplot("kvrelay dashboard")

    board = json.loads(dashboard.read_text())
    panels = [p for p in board["panels"] if p.get("targets")]
    variables = {v["name"]: v.get("allValue", ".*") for v in board.get("templating", {}).get("list", [])
                 if v.get("type") == "query"}                       # every template variable at "All"
    end = time.time()
    start, step = end - 60 * minutes, max(1.0, 60 * minutes / 300)
    cols = 2
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(13, 3.2 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    found: dict[str, int] = {}
    for ax, panel in zip(axes.flat, panels, strict=False):
        series = panel_series(prom, panel, start, end, step, variables)
        found[panel["title"]] = len(series)
        for name, ts, vs in series:
            ax.plot(ts, vs, label=name)
        ax.set_title(panel["title"] + ("" if series else "  (no data)"), fontsize=9)
        ax.set_xlabel("seconds before now", fontsize=8)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{board['title']} ({prom}, last {minutes:g} min)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return found


def main(args: argparse.Namespace) -> int:
    found = render(args.prometheus, Path(args.dashboard), args.minutes, Path(args.out))
    for title, n in found.items():
        print(f"{n:3d} series  {title}")
    print(f"kvrelay: wrote {args.out}")
    return 0
