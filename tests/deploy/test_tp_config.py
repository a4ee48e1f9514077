"""Tensor parallelism in the config tree, the launcher and the connectors' start-up checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg
from kvrelay.core.rank_view import RankView
from kvrelay.core.ranks import Heads
from kvrelay.deploy import launch
from kvrelay.deploy.config_check import stack_ports
from kvrelay.deploy.devices import gpu_placement
from kvrelay.deploy.tiny_model import make_tiny_model
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span


@pytest.mark.parametrize(("over", "names"), [
    (["engine.extra_args=[--tensor-parallel-size, 2]"], "engine.prefill_tp and engine.decode_tp"),
    (["engine.decode_args=-tp 4"], "engine.prefill_tp and engine.decode_tp"),
    (["engine.prefill_args=--pipeline-parallel-size 2"], "pipeline and data parallelism are not supported"),
    (["engine.prefill_tp=2", "connector.metrics_port=9300"], "connector.metrics_port with tensor parallelism"),
])
def test_what_tp_cannot_do_is_refused_at_load_naming_the_keys(over: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        kcfg.load(overrides=over)


def test_a_stack_gives_each_decode_rank_its_ports_and_each_engine_its_ranks() -> None:
    cfg = kcfg.load(overrides=["engine.prefill_tp=2", "engine.decode_tp=2", "deploy.decode=2", "transport.backend=tcp"])
    specs = launch.node_specs(cfg)
    assert [(s.name, s.tp, s.kv_port) for s in specs] == [("prefill0", 2, 0), ("decode0", 2, 9100), ("decode1", 2, 9102)]
    ports = stack_ports(cfg)
    assert len(set(ports.values())) == len(ports)                   # no rank's port collides with another's
    assert {ports["decode0 rank 1 transfer control"], ports["decode1 rank 1 transfer data"]} == {9101, 9203}
    cmd = launch.server_command(cfg, specs[0])
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "mp" in cmd
    assert "--tensor-parallel-size" not in launch.server_command(kcfg.load(), launch.node_specs(kcfg.load())[0])


def test_each_rank_gets_its_own_cores_and_each_node_its_own_gpus() -> None:
    n = len(launch.split_cores(0, 1))
    binding = launch.rank_binding(0, 1, 2)
    assert binding.count("|") == 1 and all(binding.split("|"))        # one core set per rank
    if n >= 2:
        assert not set(binding.split("|")[0].split(",")) & set(binding.split("|")[1].split(","))
    specs = launch.node_specs(kcfg.load(overrides=["engine.prefill_tp=2", "engine.decode_tp=1", "deploy.decode=2"]))
    assert gpu_placement(specs, ["0", "1", "2", "3"]) == {"prefill0": "0,1", "decode0": "2", "decode1": "3"}
    assert gpu_placement(specs, []) == {}                     # a CPU host: nothing placed
    with pytest.raises(ConfigError, match="needs 4 GPUs"):
        gpu_placement(specs, ["0", "1", "2"])


def test_up_refuses_a_tp_the_models_heads_do_not_allow(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")                          # 4 attention heads, 4 KV heads
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "up", "--engine.model", str(model),
                          "--engine.decode-tp", "3", "--deploy.log_dir", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "engine.decode_tp 3 does not divide" in res.stderr, res.stderr
    assert not (tmp_path / "logs").exists()                          # refused before anything started


def _vllm_config(tp: int, kv_heads: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=tp),
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads))


def test_a_worker_refuses_a_tp_its_config_does_not_state_and_mixed_tp_where_it_cannot_find_the_heads() -> None:
    cpu = KVLayout.from_caches({f"l{i}": torch.zeros(8, 2, 16, 8) for i in range(2)})   # [blocks, heads, bs, 2h]
    with pytest.raises(ConfigError, match="engine.decode_tp is 1"):
        RankView.of(_vllm_config(2, 4), cpu, kcfg.load(), "decode")
    view = RankView.of(_vllm_config(2, 4, rank=1), cpu, kcfg.load(overrides=["engine.decode_tp=2"]), "decode")
    assert view.heads == Heads(2, 4) and [pc.heads for pc in view.incoming()] == [Heads(2, 4)]
    mixed = kcfg.load(overrides=["engine.decode_tp=2", "engine.prefill_tp=1"])
    assert RankView.of(_vllm_config(2, 4, rank=1), cpu, mixed, "decode").span(Heads(2, 4)) == Span.whole(2 * 16 * 8 * 4)
    headless = KVLayout.from_caches({f"l{i}": torch.zeros(8, 16, 8) for i in range(2)})  # [blocks, bs, dim]: no heads
    with pytest.raises(ConfigError, match="no dimension of its 2 KV heads"):
        RankView.of(_vllm_config(2, 4), headless, mixed, "decode")
    assert RankView.of(_vllm_config(2, 4), headless, kcfg.load(overrides=["engine.decode_tp=2", "engine.prefill_tp=2"]),
                       "decode").incoming()                          # equal TP sends whole blocks
