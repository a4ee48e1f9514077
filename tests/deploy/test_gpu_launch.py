"""The GPU launch path, checked where no GPU is: each `kvrelay serve` node's device set (from
CUDA_VISIBLE_DEVICES, as on an 8-GPU host), the refusals, the context length left to vLLM, and
the pool launchers, which never install anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch
from kvrelay.deploy.devices import Node, node_devices, pool_problems

ROOT = Path(__file__).resolve().parents[2]
EIGHT = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def _kvrelay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def _serve_dry_run(index: int, *more: str) -> subprocess.CompletedProcess:
    return _kvrelay("serve", "--role", "prefill", "--index", str(index), "--deploy.prefill", "2",
                    "--engine.prefill-tp", "4", "--dry-run", *more, env=EIGHT)


def test_two_tp4_nodes_of_one_role_get_their_own_four_devices_and_a_third_is_refused():
    lines = [_serve_dry_run(i) for i in (0, 1)]
    assert all(r.returncode == 0 for r in lines), [r.stderr for r in lines]
    assert lines[0].stdout.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ") and "VLLM_CPU_" not in lines[0].stdout
    assert lines[1].stdout.startswith("CUDA_VISIBLE_DEVICES=4,5,6,7 ")
    assert "--tensor-parallel-size 4" in lines[0].stdout
    third = _serve_dry_run(2)
    assert third.returncode == 2 and "prefill2 (index 2, TP 4) needs devices 8..11" in third.stderr, third.stderr
    check = _kvrelay("config", "--check", "--deploy.prefill", "3", "--engine.prefill-tp", "4", env=EIGHT)
    assert check.returncode == 2 and "prefill pool of 3 x TP4" in check.stderr, check.stderr
    ok = _kvrelay("config", "--check", "--deploy.prefill", "2", "--engine.prefill-tp", "4", env=EIGHT)
    assert "pool of" not in ok.stderr, ok.stderr


def test_device_sets_follow_the_offset_an_explicit_list_or_none():
    visible = [str(d) for d in range(8)]
    cfg = kcfg.load(overrides=["deploy.device_offset=4"])
    assert node_devices(cfg, Node("decode1", "decode", 1, 2), visible) == "6,7"
    assert node_devices(kcfg.load(overrides=["deploy.devices=5,7"]), Node("d0", "decode", 0, 2), visible) == "5,7"
    assert node_devices(kcfg.load(overrides=["deploy.devices=none"]), Node("d0", "decode", 0, 2), visible) is None
    assert node_devices(kcfg.load(), Node("d0", "decode", 0, 2), []) is None             # a CPU host
    with pytest.raises(ConfigError, match="names 1 devices for d0"):
        node_devices(kcfg.load(overrides=["deploy.devices=5"]), Node("d0", "decode", 0, 2), visible)
    with pytest.raises(ConfigError, match="names 9, not among the visible"):
        node_devices(kcfg.load(overrides=["deploy.devices=1,9"]), Node("d0", "decode", 0, 2), visible)
    assert pool_problems(kcfg.load(overrides=["deploy.decode=3", "engine.decode_tp=2", "deploy.device_offset=4"]),
                         visible) == [
        "decode pool of 3 x TP2: decode2 (index 2, TP 2) needs devices 8..9 of the visible ones, but only 8 are "
        "visible (0,1,2,3,4,5,6,7): fewer nodes on this host, a smaller TP size, or deploy.device_offset / "
        "deploy.devices"]


def test_a_stack_places_its_nodes_and_tells_each_serve_to_leave_them():
    cfg = kcfg.load(overrides=["engine.prefill_tp=2"])
    spec = launch.node_specs(cfg)[0]
    cmd = launch.Stack(cfg).node_command(spec)
    assert cmd[-2:] == ["--deploy.devices", "none"]


def test_the_context_length_is_vllms_own_unless_set():
    spec = launch.node_specs(kcfg.load())[0]
    assert "--max-model-len" not in launch.server_command(kcfg.load(), spec)
    cmd = launch.server_command(kcfg.load(overrides=["engine.max_model_len=2048"]), spec)
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"


def test_the_pool_launchers_run_the_installed_build_and_never_install(tmp_path: Path):
    """On a GPU host (8 visible devices) the decode pool launcher prints each node's own device
    set and command; it runs no installer (deploy/setup.sh would put vLLM's CPU build there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\necho INSTALLER-RAN >&2\nexit 1\n")        # any install attempt shows
    (bin_dir / "pip").chmod(0o755)
    env = {**EIGHT, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(ROOT / "deploy" / "launch_decode_pool.sh"), "-n", "2", "--engine.decode-tp", "4",
                          "--dry-run"], capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["CUDA_VISIBLE_DEVICES=0,1,2,3", "CUDA_VISIBLE_DEVICES=4,5,6,7"]
    assert "INSTALLER-RAN" not in res.stderr and "kvrelay setup" not in res.stderr
    for script in ("_pool.sh", "launch_router.sh", "launch_prefill_pool.sh", "launch_decode_pool.sh"):
        assert not re.search(r"^\s*(bash\s+)?\S*setup\.sh", (ROOT / "deploy" / script).read_text(), re.M), script


def _readme_gpu_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("### GPU"):text.index("## Deploy")]
    return [ln for ln in block.splitlines() if ln.startswith("deploy/launch_")]


def test_the_readmes_two_host_gpu_commands_place_every_node_on_its_own_devices():
    """Each pool command of the README's GPU section, run with --dry-run on an 8-GPU host: every
    node gets its own TP-sized device set, they tile the 8 devices, and vLLM gets the TP size."""
    from concurrent.futures import ThreadPoolExecutor

    commands = _readme_gpu_commands()
    assert len(commands) == 4

    def dry_run(line: str) -> subprocess.CompletedProcess:
        argv = line.split()
        return subprocess.run(["bash", str(ROOT / argv[0]), *argv[1:], "--dry-run"], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **EIGHT})

    with ThreadPoolExecutor(4) as pool:                 # each is a CLI start (~2 s of imports): all at once
        results = list(pool.map(dry_run, commands))
    for line, res in zip(commands, results, strict=True):
        argv = line.split()
        n, tp = int(argv[argv.index("-n") + 1]), int(argv[argv.index("--engine.prefill-tp" if "prefill" in argv[0]
                                                                      else "--engine.decode-tp") + 1])
        assert res.returncode == 0, (line, res.stderr)
        nodes = res.stdout.splitlines()
        sets = [ln.split()[0].removeprefix("CUDA_VISIBLE_DEVICES=") for ln in nodes]
        assert sets == [",".join(str(d) for d in range(i * tp, i * tp + tp)) for i in range(n)], (line, sets)
        assert all(tp == 1 or f"--tensor-parallel-size {tp}" in ln for ln in nodes), line
