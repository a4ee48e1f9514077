"""`kvrelay bench serve --rates auto`: the rate ladder, where a system stops, and its capacity."""

from __future__ import annotations

import argparse

from kvrelay.bench.serve import capacities, capacity_table, ladder, served


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
