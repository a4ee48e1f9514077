"""`kvrelay bench e2e`'s interleaving and paired ratios (pure logic; the benchmark itself runs real stacks)."""

from __future__ import annotations

import json
import math

from kvrelay.bench import e2e
from kvrelay.bench.e2e import Samples, System, measure_interleaved, paired_ratio, rotation, rows_of
from kvrelay.core import config as kcfg


class _Bar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, k: int) -> None:
        self.n += k


def test_each_system_leads_a_round_equally_often() -> None:
    labels = ["a", "b", "c"]
    firsts = [rotation(labels, rep)[0] for rep in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(rotation(labels, rep)) == labels for rep in range(6))


def test_paired_ratios_cancel_a_drift_that_ratios_of_medians_do_not() -> None:
    # the host slows down 3x halfway through: run one system after the other and its
    # median moves; interleave and the same round's pair sees the same slowdown
    sent: list[tuple[str, int, str]] = []
    clock = {"n": 0}

    def system(label: str, cost: float) -> System:
        def flow(prompt: str, rid: str) -> tuple[float, list[float]]:
            clock["n"] += 1
            slow = 3.0 if clock["n"] > 12 else 1.0
            sent.append((label, len(prompt), rid))
            return cost * slow, [0.001]
        return System(label, flow, lambda: None)

    samples = Samples()
    bar = _Bar()
    systems = [system("single-p", 0.010), system("kvrelay-tcp", 0.012)]
    measure_interleaved(systems, [240], 12, samples, bar, pause_s=0)
    assert bar.n == 24
    # the same prompt went to both systems in every round
    prompts = {(label, n) for label, n, _ in sent}
    assert prompts == {("single-p", 240), ("kvrelay-tcp", 240)}
    assert math.isclose(paired_ratio(samples, "kvrelay-tcp", "single-p", 240), 1.2)
    rows = rows_of(samples, ["single-p", "kvrelay-tcp"], [240])
    assert [r["system"] for r in rows] == ["single-p", "kvrelay-tcp"]
    assert math.isclose(rows[1]["paired_vs_single_p"], 1.2)
    assert math.isnan(rows[1]["paired_vs_nixl_fair"])          # no such peer in this run
    assert len(rows[0]["ttft_all_ms"]) == 12


def test_a_round_one_system_missed_is_left_out_of_its_pairs() -> None:
    samples = Samples()
    for rep, (a, b) in enumerate([(1.0, 2.0), (1.0, 4.0), (1.0, 3.0)]):
        samples.add("single-p", 240, rep, a, [])
        if rep != 1:
            samples.add("kvrelay-nixl", 240, rep, b, [])
    assert paired_ratio(samples, "kvrelay-nixl", "single-p", 240) == 2.5


def test_the_breakdown_charges_each_step_with_what_it_adds_over_the_previous_one() -> None:
    from kvrelay.bench.breakdown import STEPS, summarize

    # single-p drifts 10 -> 30 ms over the rounds; each later step adds 1 ms more in every round
    base = [0.010, 0.020, 0.030]
    took = {name: [b + 0.001 * k for b in base] for k, name in enumerate(STEPS)}
    rows = summarize(took)
    assert [r["step"] for r in rows] == list(STEPS)
    assert [round(r["added_ms"], 6) for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [round(r["vs_single_p_ms"], 6) for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert rows[0]["vs_single_p"] == 1.0


def test_systems_that_do_not_fit_in_memory_together_run_one_after_the_other(tmp_path, capsys) -> None:
    from kvrelay.bench.e2e import fits_together

    labels = ["single", "single-p", "kvrelay-tcp", "kvrelay-nixl", "nixl-fair"]     # 8 engines
    roomy, tight = tmp_path / "roomy", tmp_path / "tight"
    roomy.write_text("MemTotal: 25000000 kB\nMemAvailable:   24000000 kB\n")
    tight.write_text("MemTotal: 16000000 kB\nMemAvailable:   12000000 kB\n")
    assert fits_together(labels, str(roomy))
    assert not fits_together(labels, str(tight))
    assert "--sequential" in capsys.readouterr().err
    assert fits_together(labels[:2], str(tight))


def test_tp_systems_are_labelled_counted_and_their_ranks_transfers_read_as_one(tmp_path) -> None:
    assert e2e.kvrelay_label("tcp", "decode", 2, 1) == "kvrelay-tcp-tp2x1"
    assert e2e.kvrelay_label("nixl", "prefill", 1, 1) == "kvrelay-nixl-p"          # token 1 from P
    assert [e2e.kvrelay_label("tcp", "decode", 1, 1, e2e.DECODE_FIRST[v]) for v in ("auto", "on", "off")] == [
        "kvrelay-tcp", "kvrelay-tcp-df", "kvrelay-tcp-nodf"]          # no flag: kvrelay's own defaults
    assert e2e.kvrelay_label("tcp", kcfg.from_dict({}).router.first_token.value, 1, 1) == "kvrelay-tcp"
    assert e2e.engines_of("kvrelay-tcp-tp2x1") == 3 and e2e.engines_of("kvrelay-tcp") == 2
    # prefill TP2 -> decode TP1: two sub-transfers (one per prefill rank) of one 1-chunk request
    evs = [{"event": "push_start", "transfer": "t1#p0", "chunk": 0, "t": 10.0},
           {"event": "push_start", "transfer": "t1#p1", "chunk": 0, "t": 10.002},
           {"event": "install", "transfer": "t1#p0", "chunk": 0, "t_start": 10.004, "t_end": 10.005},
           {"event": "install", "transfer": "t1#p1", "chunk": 0, "t_start": 10.006, "t_end": 10.010},
           {"event": "load_done", "transfer": "t1", "chunks": 1, "prompt_tokens": 240}]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in evs))
    got = e2e.exposed_transfer(path, 256)
    assert abs(got["one_chunk_ms"] - 10.0) < 1e-6          # first piece started -> last piece installed
    assert abs(got["exposed_ms"][240] - 6.0) < 1e-6         # last piece installed - first install
