"""``pip install .`` installs one importable name, ``kvrelay``, with every room under it.

The wheel is built from a copy of this checkout (no network: no build isolation, no dependencies) and
installed into an empty target directory; the test then reads that installed distribution's
own metadata (``importlib.metadata`` over the target only) and the files it put there.
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow          # builds and installs a wheel (~40 s)
ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"common", "transport", "store", "kernels", "core", "prefill", "decode", "router", "deploy", "bench"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pkg")
    src, wheels, target = tmp / "src", tmp / "wheels", tmp / "site"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build", "*.egg-info",
                                                             "kvrelay-logs", "bench_results"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("kvrelay-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return target


def test_kvrelay_is_the_only_top_level_name(installed: Path):
    (dist,) = [d for d in md.distributions(path=[str(installed)]) if d.metadata["Name"] == "kvrelay"]
    top = {line.strip() for line in (dist.read_text("top_level.txt") or "").splitlines() if line.strip()}
    assert top == {"kvrelay"}, top
    roots = {Path(str(f)).parts[0] for f in dist.files or ()}
    assert {r for r in roots if not r.endswith(".dist-info") and r not in ("bin", "..")} == {"kvrelay"}, roots  # .. = scripts
    on_disk = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert on_disk == {"kvrelay"}, on_disk


def test_every_room_is_a_subpackage_and_vllm_gets_the_new_paths(installed: Path):
    assert {p.name for p in (installed / "kvrelay").iterdir() if (p / "__init__.py").exists()} == ROOMS
    assert (installed / "kvrelay" / "deploy" / "monitoring" / "alerts.yaml").exists()
    (dist,) = [d for d in md.distributions(path=[str(installed)]) if d.metadata["Name"] == "kvrelay"]
    plugins = {e.name: e.value for e in dist.entry_points if e.group == "vllm.general_plugins"}
    assert plugins == {"kvrelay_mq_busy_loop": "kvrelay.core.vllm_plugin:register",
                       "kvrelay_moved_modules": "kvrelay.core.moved:register"}, plugins
    code = "import kvrelay.prefill.connector, kvrelay.decode.connector, kvrelay.router.app, kvrelay.cli"
    res = subprocess.run([sys.executable, "-c", code], cwd=installed, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
