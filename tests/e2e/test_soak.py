"""The 5-minute soak (``kvrelay bench soak --quick``) in CI: mixed traffic on a 1P2D stack with
the store on (CPU, disk, Redis) while a decode node is SIGKILLed and restarted, Redis is
killed and started again empty, and the prefill node is drained and restarted.

Every greedy answer that completed equals one vLLM's, nothing hangs or is lost without an
error, the engines end idle and the router's RSS and descriptors stay flat; the recovery
matrix has a row for each fault that ran. (The hour-long run and its table: docs/lab/soak.md.)
"""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("vllm")

from kvrelay.bench import soak  # noqa: E402
from kvrelay.bench.soak_faults import QUICK  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1500)]


def test_five_minutes_of_faults_lose_nothing_and_change_no_answer(tmp_path, tiny_model, plain):
    ap = argparse.ArgumentParser()
    soak.add_args(ap)
    # eager, as every engine the tests start (tests/e2e/harness.py: EAGER): the soak's engines
    # otherwise compile at each start and restart (25-60 s each on 2 cores); the session's plain
    # servers (the same model, eager, one pinned thread each) give the reference answers
    with plain.use(2) as urls:
        args = ap.parse_args(["--quick", "--base-port", "26200", "--out", str(tmp_path),
                              "--engine.model", str(tiny_model), "--engine.extra-args", "[--enforce-eager]",
                              *(arg for url in urls for arg in ("--reference-url", url))])
        assert soak.main(args) in (0, 1)
    summary = json.loads((tmp_path / "soak.json").read_text())
    table = (tmp_path / "table.txt").read_text()
    print(table)
    ran = {r["kind"] for r in summary["matrix"] if not r["skipped"]}
    assert ran == {k.value for k in QUICK}, table
    assert summary["exactness"]["greedy_completed"] > 50, table
    assert summary["checks"] == dict.fromkeys(summary["checks"], True), table
    assert (tmp_path / "soak.png").stat().st_size > 0
