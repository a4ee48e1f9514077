"""A node's local sockets: in its own private directory, and removed when vLLM stops, crash or not."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg
from kvrelay.deploy import node_files
from kvrelay.deploy.launch import NodeSpec, Role
from kvrelay.deploy.supervisor import DrainPlan, Scratch, Supervisor
from kvrelay.prefill.lookup import lookup_endpoint

# A stand-in for vLLM: binds a ZeroMQ ipc socket where vLLM would, then waits to be killed.
BINDER = [sys.executable, "-c", "import os, time, zmq\n"
          "s = zmq.Context().socket(zmq.PUB)\n"
          "s.bind(f\"ipc://{os.environ['VLLM_RPC_BASE_PATH']}/0f1e2d3c-0000-4000-8000-000000000000\")\n"
          "open(os.environ['VLLM_RPC_BASE_PATH'] + '/bound', 'w').close()\n"
          "time.sleep(120)\n"]


def _cfg(tmp_path: Path, **connector: str) -> kcfg.KVRelayConfig:
    return kcfg.from_dict({"connector": {"runtime_dir": str(tmp_path / "run"), **connector}})


def test_a_killed_engine_leaves_nothing_behind_and_a_stale_directory_is_emptied(short_tmp: Path):
    tmp_path = short_tmp
    cfg = _cfg(tmp_path)
    spec = NodeSpec(Role.DECODE, 0, 18101, 18400)
    own = node_files.ipc_dir(cfg, spec)
    (tmp_path / "run").mkdir(mode=0o700)
    own.mkdir(mode=0o755)
    (own / "stale.sock").touch()                        # what a SIGKILLed supervisor left
    events = tmp_path / "run" / "kv-events-decode0-18101.sock"
    events.touch()
    logging_config = tmp_path / "run" / "decode0-18101.drain.logging.json"
    logging_config.write_text("{}")                    # written for vLLM before it starts: kept until it exits
    env = {**os.environ, node_files.RPC_BASE_ENV: str(own)}
    scratch = node_files.scratch(cfg, spec, env)
    assert scratch.dirs == (own,) and events in scratch.files
    sup = Supervisor(BINDER, env, DrainPlan(str(tmp_path / "d"), 5, 1), lambda: False, scratch=scratch)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(sup.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not (own / "bound").exists():
        assert time.monotonic() < deadline, "the stand-in never bound its socket"
        time.sleep(0.05)
    assert sorted(p.name for p in own.iterdir()) == ["0f1e2d3c-0000-4000-8000-000000000000", "bound"]
    assert own.stat().st_mode & 0o777 == 0o700 and logging_config.exists() and events.exists()
    assert sup.child is not None
    sup.child.kill()                                    # a crash: no shutdown path runs
    t.join(10)
    assert rc == [-9] and not own.exists() and not events.exists() and not logging_config.exists()


def test_the_operators_own_rpc_path_is_left_alone(short_tmp: Path):
    cfg = _cfg(short_tmp)
    spec = NodeSpec(Role.PREFILL, 0, 18100)
    assert node_files.scratch(cfg, spec, {node_files.RPC_BASE_ENV: "/var/run/mine"}).dirs == ()


def test_a_runtime_directory_too_long_for_a_unix_socket_is_refused_naming_the_setting(tmp_path: Path):
    long = tmp_path / ("r" * 40)
    with pytest.raises(ConfigError, match=r"connector\.runtime_dir .* too long"):
        node_files.ipc_dir(_cfg(tmp_path, runtime_dir=str(long)), NodeSpec(Role.PREFILL, 0, 18100))
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", "prefill", "--dry-run",
                          "--connector.runtime_dir", str(long)], capture_output=True, text=True,
                         env={"KVRELAY_SECRET": "x" * 32, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "too long" in out.stderr


def test_serve_points_vllm_at_the_nodes_directory_and_the_store_socket_follows(short_tmp: Path):
    tmp_path = short_tmp
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", "decode", "--dry-run",
                          "--connector.runtime_dir", str(tmp_path / "run"), "--port", "18101"],
                         capture_output=True, text=True, env={"KVRELAY_SECRET": "x" * 32, "PATH": "/usr/bin:/bin"},
                         check=True).stdout
    assert f"VLLM_RPC_BASE_PATH={tmp_path / 'run' / 'decode0-18101.ipc'} " in out
    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="e1"))
    assert lookup_endpoint(vc, {"VLLM_RPC_BASE_PATH": "/r/p0.ipc"}).startswith("ipc:///r/p0.ipc/kvrelay-store-")


def test_scratch_with_nothing_there_is_no_error(tmp_path: Path):
    s = Scratch((tmp_path / "a",), (tmp_path / "b.sock",))
    s.remove()
    s.prepare()
    assert (tmp_path / "a").is_dir()
    s.remove()
    assert not (tmp_path / "a").exists()
