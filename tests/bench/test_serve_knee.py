"""`kvrelay bench serve`: the rate ladder, where a system stops, its capacity, the rows' figures, --set."""

from __future__ import annotations

import argparse

import pytest

from kvrelay.bench import serve
from kvrelay.bench.serve import capacities, capacity_table, ladder, served
from kvrelay.common.errors import ConfigError


def test_the_ladder_climbs_geometrically_to_the_cap():
    args = argparse.Namespace(rates="auto", rate_start=1.0, rate_step=1.5, rate_max=6.0)
    assert ladder(args) == [1.0, 1.5, 2.25, 3.38, 5.06]
    assert ladder(argparse.Namespace(rates="1,3")) == [1.0, 3.0]


def test_capacity_is_the_highest_rate_served_at_90_percent():
    rows = [{"system": "a", "rate": 1.0, "goodput": 1.0}, {"system": "a", "rate": 2.0, "goodput": 1.85},
            {"system": "a", "rate": 3.0, "goodput": 2.5}, {"system": "b", "rate": 1.0, "goodput": 0.5},
            {"system": "c", "rate": 1.0, "goodput": None}]
    assert [served(r) for r in rows] == [True, True, False, False, False]
    caps = capacities(rows)
    assert caps == {"a": 2.0, "b": 0.0, "c": 0.0}
    table = capacity_table(caps, ("a", "b"))
    assert "1.00" in table.splitlines()[1] and "nan" in table.splitlines()[1]


def test_rows_report_the_token_1_to_2_gap_and_overrides_parse_as_yaml():
    res = {"completed": 3, "request_throughput": 1.0, "request_goodput": 1.0, "output_throughput": 9.0,
           "itls": [[0.030, 0.006], [0.010, 0.005, 0.006], [], [0.020]]}
    row = serve._row("kvrelay-nixl-df", 1.0, res)
    assert row["gap12_p50"] == pytest.approx(20.0) and row["gap12_p99"] == pytest.approx(29.8)
    assert serve._row("x", 1.0, {})["gap12_p50"] is None
    assert serve.overrides(["connector.sync_landed=false", "router.disagg_min_tokens=64"]) == {
        "connector__sync_landed": False, "router__disagg_min_tokens": 64}
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        serve.overrides(["sync_landed=false"])
