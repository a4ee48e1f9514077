"""`kvrelay bench router` runs end to end (small): four systems, a table, JSON and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow                   # 18 s of real processes: the full suite runs it, the everyday tier does not
def test_bench_router_smoke(tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "router", "--requests", "32", "--duration", "1",
                        "--base-port", "18640", "--pace-ms", "2", "--rounds", "2", "--settle-s", "0",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "router.json").read_text())["rows"]
    assert set(rows) == {"direct", "kvrelay", "kvrelay-df", "toy"}
    for row in rows.values():
        assert row["rps"] > 0 and row["c1"]["p50_ms"] > 0 and 0 < row["core_busy"] < 1.5
        assert row["c64paced"]["p50_ms"] >= 64 * 2          # the paced upstream really waited between tokens
        # net of the upstream's own time (>= 64 paces of 2 ms on every path): the hops and the proxy's work
        assert 0 < row["c64paced"]["net_p50_ms"] < row["c64paced"]["p50_ms"] - 60 * 2
        assert 0 < row["c1"]["net_p50_ms"] < row["c1"]["p50_ms"]
    for name in ("kvrelay", "kvrelay-df"):   # each on its own path (split; decode-first's D alone): the run
        assert rows[name]["path"]["requests_ok"] > 32   # fails on any other path, error or fallback counted
    assert (tmp_path / "router.png").stat().st_size > 1000
    assert "vs toy" in r.stdout and "+paced p50" in r.stdout and "net+pc50" in r.stdout
