"""mypy checks kvrelay's own types across packages: a planted error in code that uses kvrelay's
classes is reported, and a transport class is itself, not ``Any`` (pyproject.toml [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")
ROOT = Path(__file__).resolve().parents[1]

PLANTED = '''
from kvrelay.common.keys import Fingerprint, chunk_keys
from kvrelay.transport.events import ChunkArrival

reveal_type(ChunkArrival)
fp = Fingerprint("m", "float32", "cpu", 128, 4, 65536)
wrong: str = chunk_keys([1, 2, 3], fp, 256)
'''


def test_mypy_resolves_kvrelay_and_reports_a_planted_error(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(PLANTED)
    res = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "cache"), str(probe)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = res.stdout
    assert 'Revealed type is "def (' in out and "kvrelay.transport.events.ChunkArrival" in out, out
    assert 'Incompatible types in assignment (expression has type "list[bytes]", variable has type "str")' in out, out
    assert "import-not-found" not in out and "import-untyped" not in out, out
    assert res.returncode == 1
