"""core/vllm_plugin.py: vLLM's message-queue busy-wait window, set through a vLLM general plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.core import config as kcfg
from kvrelay.core.vllm_plugin import BUSY_LOOP_ENV, apply, busy_loop_s
from kvrelay.deploy import launch


def test_the_window_is_read_from_the_environment_and_checked():
    assert busy_loop_s({}) is None and busy_loop_s({BUSY_LOOP_ENV: " "}) is None
    assert busy_loop_s({BUSY_LOOP_ENV: "0.002"}) == 0.002 and busy_loop_s({BUSY_LOOP_ENV: "0"}) == 0
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=BUSY_LOOP_ENV):
            busy_loop_s({BUSY_LOOP_ENV: bad})


def test_apply_sets_the_default_and_keeps_explicit_values():
    class Spin:
        def __init__(self, is_reader: bool, busy_loop_s: float = 1) -> None:
            self.busy_loop_s = busy_loop_s

    assert apply(Spin, 0.002) and apply(Spin, 0.003)             # twice: the second value wins, no double wrap
    assert Spin(True).busy_loop_s == 0.003 and Spin(True, busy_loop_s=5).busy_loop_s == 5

    class Other:
        def __init__(self, is_reader: bool) -> None: ...
    assert not apply(Other, 0.002)


def test_the_launcher_sets_it_for_every_vllm_server_unless_minus_one(monkeypatch):
    monkeypatch.delenv(BUSY_LOOP_ENV, raising=False)
    assert launch.server_env(kcfg.from_dict({}), 0, 2)[BUSY_LOOP_ENV] == "0.002"
    assert BUSY_LOOP_ENV not in launch.server_env(kcfg.from_dict({"engine": {"mq_busy_loop_s": -1}}), 0, 2)


@pytest.mark.slow                   # imports vLLM in a fresh interpreter (10 s): the full suite runs it
def test_vllm_loads_the_plugin_and_its_queue_readers_get_the_window(short_tmp: Path):
    """In a fresh interpreter, through vLLM's own plugin loader and its real SpinCondition."""
    code = """
import os
import zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
load_general_plugins()
ctx = zmq.Context()
addr = "ipc://%s/notify" % os.environ["VLLM_RPC_BASE_PATH"]
writer = SpinCondition(is_reader=False, context=ctx, notify_address=addr)
reader = SpinCondition(is_reader=True, context=ctx, notify_address=addr)
print(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, reader.busy_loop_s, writer.busy_loop_s)
"""
    env = {**os.environ, BUSY_LOOP_ENV: "0.004", "VLLM_RPC_BASE_PATH": str(short_tmp)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-3:] == ["10", "0.004", "0"]      # a short window parks often: recheck often
    env.pop(BUSY_LOOP_ENV)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split()[-3:] == ["5000", "1", "0"], r.stderr[-2000:]   # unset: vLLM's own defaults, untouched
