"""`kvrelay bench serve`: the rate ladder, where a system stops, its capacity, the rows' figures; the config
flags every bench that starts stacks shares (bench/stack_flags.py)."""

from __future__ import annotations

import argparse

import pytest

from kvrelay import cli
from kvrelay.bench import serve, stack_flags
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


def test_rows_report_the_token_1_to_2_gap():
    res = {"completed": 3, "request_throughput": 1.0, "request_goodput": 1.0, "output_throughput": 9.0,
           "itls": [[0.030, 0.006], [0.010, 0.005, 0.006], [], [0.020]]}
    row = serve._row("kvrelay-nixl-df", 1.0, res)
    assert row["gap12_p50"] == pytest.approx(20.0) and row["gap12_p99"] == pytest.approx(29.8)
    assert serve._row("x", 1.0, {})["gap12_p50"] is None


BENCHES_WITH_STACKS = ("e2e", "breakdown", "serve", "multiturn", "soak", "transfer")


def _bench_parser(name: str) -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    cli._add_bench_commands(root)
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name", BENCHES_WITH_STACKS)
def test_every_bench_takes_the_config_flags_of_kvrelay_up(name: str) -> None:
    # one flag style: the config tree's own flags, as `kvrelay up` has them; no --set
    p = _bench_parser(name)
    flags = {o for a in p._actions for o in a.option_strings}
    assert {"--config", "--router.decode-first", "--connector.sync-landed", "--transport.backend"} <= flags
    assert "--set" not in flags
    for a in p._actions:                        # every flag says what it takes
        if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS:
            assert a.metavar not in (None, "V"), a.option_strings


def test_a_bench_stack_is_the_users_file_then_the_bench_then_the_users_flags(tmp_path) -> None:
    (tmp_path / "k.yaml").write_text("router:\n  stall_timeout_s: 7\n  port: 1\nconnector:\n  sync_landed: false\n")
    args = _bench_parser("serve").parse_args(["--config", str(tmp_path / "k.yaml"), "--router.disagg-min-tokens", "64",
                                              "--connector.sync-landed", "true"])
    cfg = stack_flags.build(args, {"router": {"port": 5050, "disagg_min_tokens": 8}, "deploy": {"base_port": 5000}})
    assert cfg.router.stall_timeout_s == 7              # the file
    assert cfg.router.port == 5050 and cfg.deploy.base_port == 5000    # the bench's own ports over the file
    assert cfg.router.disagg_min_tokens == 64 and cfg.connector.sync_landed     # flags last
    with pytest.raises(SystemExit):                     # a typo is an error, never a silent default
        _bench_parser("serve").parse_args(["--router.no-such-key", "1"])
    with pytest.raises(ConfigError, match="no_such"):
        stack_flags.build(argparse.Namespace(), {"router": {"no_such": 1}})
