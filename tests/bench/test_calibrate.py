"""`kvrelay calibrate`'s decision rule, on measured-looking rows."""

from __future__ import annotations

from kvrelay.bench.calibrate import recommend


def _row(n: int, ttft_pd: float, ttft_d: float, stall_d: float) -> dict:
    return {"tokens": n, "ttft_pd": ttft_pd, "ttft_d": ttft_d, "stall_d": stall_d}


def test_the_crossover_is_the_last_length_where_d_alone_wins_everywhere_below():
    rows = [_row(64, 0.03, 0.02, 0.005), _row(256, 0.05, 0.04, 0.02), _row(512, 0.09, 0.08, 0.05),
            _row(1024, 0.15, 0.16, 0.1)]
    assert recommend(rows, 0.03) == (256, True)        # 512 stalls D's streams past the budget
    assert recommend(rows, 0.06) == (512, True)        # 1024: P + push is faster even for this request
    assert recommend(rows[:2], 0.03) == (256, False)   # never crossed: say so
    assert recommend([_row(64, 0.02, 0.03, 0.0)], 1.0) == (0, True)    # a faster prefill node wins at once
    assert recommend(rows) == (512, True)              # idle D: no one to stall, TTFT alone decides
