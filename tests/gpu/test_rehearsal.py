"""The GPU check rehearsed on CPU: the one script a lent GPU runs (``tests/gpu/check.sh``) must
run end to end here first, every step byte-exact, so the device's minutes are not spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow                     # half a minute: the full suite runs it, the everyday tier does not
def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path: Path):
    res = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "check.sh"), "--rehearse"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_rehearsal.json").read_text())["rows"]
    steps = {r["step"] for r in rows}
    assert {"kernels gather", "heads-nhd scatter", "heads-hnd gather", "nixl from DRAM into a host pool",
            "nixl from DRAM into a tensor pool", "workers nhd P2->D4 tcp", "workers hnd P4->D1 tcp",
            "workers nhd P2->D4 nixl"} <= steps, steps
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert "step" in res.stdout and "workers nhd P1->D1 tcp" in res.stdout      # the printed table


BLOCK_VLLM = """
import sys
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vLLM on this machine")
sys.meta_path.insert(0, NoVllm())
"""


def test_the_worker_halves_run_where_there_is_no_vllm():
    """The lent GPU machines have torch and Triton but no vLLM: the check's worker step must
    import and run the connectors' worker halves without it."""
    code = BLOCK_VLLM + "from tests.gpu.halves import run_pair\nr = run_pair('nhd', 2, 1)\nassert r.exact, r.mismatches\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
