"""The worker half of core/engine_stats.py: what a step ships to the engine's /metrics.

tests/e2e/test_pd.py checks the whole path on real vLLM (engine /metrics = worker exporter)."""

from __future__ import annotations

from kvrelay.core.engine_stats import RelayStats, StatsTracker
from kvrelay.core.telemetry import metrics


def test_deltas_are_increments_and_changed_gauges_throttled_unless_forced():
    m, now = metrics(), [100.0]
    tracker = StatsTracker(m, interval_s=1.0, clock=lambda: now[0])
    tracker.delta(force=True)                                  # the baseline: whatever this process has
    m.chunks.labels("decode", "installed").inc(3)
    m.tokens_loaded.inc(512)
    m.transfer_latency.observe(0.25)
    m.pool_leased.set(7)
    now[0] += 0.1
    assert tracker.delta() is None                             # within the interval: nothing shipped yet
    d = tracker.delta(force=True)                              # a transfer settled in this step
    assert d is not None
    assert ["kvrelay_chunks", {"side": "decode", "outcome": "installed"}, 3.0] in d.data["inc"]
    assert ["kvrelay_tokens_loaded", {}, 512.0] in d.data["inc"]
    assert ["kvrelay_pool_slots_busy", {}, 7.0] in d.data["set"]
    assert ["kvrelay_transfer_latency_seconds", [0.25]] in d.data["obs"]
    now[0] += 5
    assert tracker.delta() is None                             # nothing changed since
    m.tokens_loaded.inc(1)
    now[0] += 5
    later = tracker.delta()
    assert later is not None and later.data["inc"] == [["kvrelay_tokens_loaded", {}, 1.0]]
    total = RelayStats(data=d.data).aggregate(later)
    assert total.reduce()["kvrelay_tokens_loaded"] == 513.0 and not total.is_empty()
