"""`kvrelay bench serve --base-url`: vLLM's serving client against any running OpenAI-compatible
endpoint, here a kvrelay router that demands an API key (as a user's deployment would), over
the shared tcp stack's engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("pd_stack", ["tcp"], indirect=True)]
KEY = "sk-bench-endpoint-0123456789"
NAME = "keyed"            # the endpoint's label in the report


@pytest.fixture(scope="module")
def endpoint(pd_stack) -> Iterator[str]:
    from tests.e2e.routers import second_router

    with second_router(pd_stack, "bench", pd_stack.cfg.router.port + 5, decode_first=False, api_keys=[KEY]) as h:
        yield h.router_url


def _bench(url: str, out: Path, key: str | None, tokenizer: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if key:
        env["OPENAI_API_KEY"] = key
    cmd = [sys.executable, "-m", "kvrelay.cli", "bench", "serve", "--base-url", f"{NAME}={url}", "--rates", "2",
           "--num-prompts", "6", "--prefix-len", "16", "--input-len", "48", "--output-len", "6", "--tokenizer", str(tokenizer), "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_bench_serve_measures_a_running_endpoint_in_vllms_format(endpoint: str, tiny_model: Path, tmp_path: Path):
    res = _bench(endpoint, tmp_path, KEY, tiny_model)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = tmp_path.glob("serve-*")
    summary = json.loads((run / "serve.json").read_text())
    assert summary["endpoints"] == {NAME: endpoint} and summary["model"] == MODEL
    (row,) = summary["rows"]
    assert row["system"] == NAME and row["completed"] == 6 and row["failed"] == 0
    vllm_result = json.loads((run / NAME / "rate-2.json").read_text())        # vllm bench serve's own file
    assert {"request_throughput", "median_ttft_ms", "p99_itl_ms", "request_goodput"} <= set(vllm_result)
    assert vllm_result["completed"] == 6
    assert (run / "serve.png").stat().st_size > 10_000
    assert NAME in res.stdout or NAME in (run / "table.txt").read_text()
    assert KEY not in (run / NAME / "rate-2.log").read_text()


def test_an_endpoint_that_refuses_the_key_is_one_clear_line(endpoint: str, tiny_model: Path, tmp_path: Path):
    res = _bench(endpoint, tmp_path, None, tiny_model)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "GET /v1/models failed" in res.stderr and "--api-key" in res.stderr
