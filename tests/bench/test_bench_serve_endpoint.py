"""`kvrelay bench serve --base-url`: vLLM's serving client against any running OpenAI-compatible
endpoint, here one plain vLLM server that demands an API key (as a user's deployment would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.deploy import launch
from tests.e2e.harness import MODEL, _cfg

pytestmark = pytest.mark.slow          # one vLLM server (~45 s) and two short load runs
PORT = 18760
KEY = "sk-bench-endpoint-0123456789"


@pytest.fixture(scope="module")
def plain_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("plain")
    cfg = _cfg(tiny_model, tmp, PORT)
    env = dict(launch.server_env(cfg, 0, 1), VLLM_API_KEY=KEY)       # vLLM's own key check, not on a command line
    with open(tmp / "vllm.log", "w") as log:
        proc = launch.spawn_group(launch.server_command(cfg, launch.NodeSpec(launch.Role.SINGLE, 0, PORT)), env, log)
    try:
        launch.wait_healthy(f"http://127.0.0.1:{PORT}", proc, 900, str(tmp / "vllm.log"))
        yield f"http://127.0.0.1:{PORT}"
    finally:
        launch.stop_group(proc)


def _bench(url: str, out: Path, key: str | None, tokenizer: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if key:
        env["OPENAI_API_KEY"] = key
    cmd = [sys.executable, "-m", "kvrelay.cli", "bench", "serve", "--base-url", f"plain={url}", "--rates", "2",
           "--num-prompts", "6", "--prefix-len", "16", "--input-len", "48", "--output-len", "6", "--tokenizer", str(tokenizer), "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_bench_serve_measures_a_running_endpoint_in_vllms_format(plain_vllm: str, tiny_model: Path, tmp_path: Path):
    res = _bench(plain_vllm, tmp_path, KEY, tiny_model)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = tmp_path.glob("serve-*")
    summary = json.loads((run / "serve.json").read_text())
    assert summary["endpoints"] == {"plain": plain_vllm} and summary["model"] == MODEL
    (row,) = summary["rows"]
    assert row["system"] == "plain" and row["completed"] == 6 and row["failed"] == 0
    vllm_result = json.loads((run / "plain" / "rate-2.json").read_text())        # vllm bench serve's own file
    assert {"request_throughput", "median_ttft_ms", "p99_itl_ms", "request_goodput"} <= set(vllm_result)
    assert vllm_result["completed"] == 6
    assert (run / "serve.png").stat().st_size > 10_000
    assert "plain" in res.stdout or "plain" in (run / "table.txt").read_text()
    assert KEY not in (run / "plain" / "rate-2.log").read_text()


def test_an_endpoint_that_refuses_the_key_is_one_clear_line(plain_vllm: str, tiny_model: Path, tmp_path: Path):
    res = _bench(plain_vllm, tmp_path, None, tiny_model)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "GET /v1/models failed" in res.stderr and "--api-key" in res.stderr
