"""``kvrelay bench transfer``'s consumer A/B: the three consumer steps measured and tabled."""

from __future__ import annotations

from kvrelay.bench.transfer import consumer_cost, consumer_table
from kvrelay.common.wire import FUSE_FROM


def test_consumer_cost_times_every_step_and_states_the_ratios():
    rows = consumer_cost([64 << 10, FUSE_FROM], reps=1)
    assert [r["size"] for r in rows] == [64 << 10, FUSE_FROM]
    for r in rows:
        assert min(r["copy_us"], r["copy+hash_us"], r["copy_checked_us"]) > 0
        assert r["fused_vs_two_pass"] == r["copy_checked_us"] / r["copy+hash_us"]
        assert r["fused_vs_copy"] == r["copy_checked_us"] / r["copy_us"]
        assert r["verify_cap"] == r["copy_us"] / r["copy_checked_us"]
    text = consumer_table(rows)
    assert "64 KiB" in text and "2 MiB" in text and "copy_checked" in text and "cap" in text
