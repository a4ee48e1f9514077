"""``pip install .`` installs one importable name, ``kvrelay``, with every room under it.

The wheel is built from a copy of this checkout (no network: no build isolation, no dependencies) and
installed into an empty target directory; the test then reads that installed distribution's
own metadata (``importlib.metadata`` over the target only) and the files it put there.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvrelay.common.secrets import SECRET_ENV
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch

pytestmark = pytest.mark.slow          # builds and installs a wheel (~40 s), and one with its dependencies
ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"common", "transport", "store", "kernels", "core", "prefill", "decode", "router", "deploy", "bench"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pkg")
    src, wheels = tmp / "src", tmp / "wheels"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build", "*.egg-info",
                                                             "kvrelay-logs", "bench_results"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)
    (built,) = wheels.glob("kvrelay-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
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
    assert plugins == {"kvrelay_mq_busy_loop": "kvrelay.core.vllm_plugin:register"}, plugins
    code = "import kvrelay.prefill.connector, kvrelay.decode.connector, kvrelay.router.app, kvrelay.cli"
    res = subprocess.run([sys.executable, "-c", code], cwd=installed, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("pd_stack", ["tcp"], indirect=True)
def test_router_only_install_serves_a_request(wheel: Path, pd_stack, tmp_path: Path):
    """``pip install kvrelay[router]`` into an empty virtual environment (dependencies from the
    package index) brings neither torch, vLLM nor matplotlib, and its ``kvrelay router`` (decode-first,
    tokenising with transformers alone) serves a request through a running stack with the same answer
    as the stack's own router."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", "-q", "install", f"{wheel}[router]"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    probe = ("import importlib.util as u, sys; import kvrelay.router.app, kvrelay.cli; "
             "print([m for m in ('torch', 'vllm', 'matplotlib', 'nixl') if u.find_spec(m)])")
    res = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr[-2000:])
    data = kcfg.to_dict(pd_stack.stack.router_config())
    port = pd_stack.cfg.router.port + 7
    data["router"]["port"] = port
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with open(tmp_path / "router.log", "w") as log:
        proc = subprocess.Popen([str(venv / "bin" / "kvrelay"), "router", "--config", str(tmp_path / "router.yaml")],
                                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
                                     **{k: v for k, v in os.environ.items() if k == SECRET_ENV}})
    try:
        launch.wait_healthy(f"http://127.0.0.1:{port}", proc, 60, str(tmp_path / "router.log"))
        body = {"model": launch.served_name(pd_stack.cfg), "prompt": "The router-only install says",
                "max_tokens": 12, "temperature": 0}
        got = _post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["text"]
        want = _post(f"{pd_stack.router_url}/v1/completions", body)["choices"][0]["text"]
        assert got == want and got
    finally:
        launch.stop_group(proc)
