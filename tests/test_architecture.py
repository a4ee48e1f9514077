"""The rooms hold: import rules (import-linter contracts in pyproject.toml) and size limits.

The contracts are checked on this tree, and each rule is shown to bite on a copy of the
tree with one forbidden import added - so a contract that silently stopped matching
would fail here too.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["kvrelay", "bench", "deploy", "router", "prefill", "decode", "core", "kernels", "transport"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

pytest.importorskip("importlinter")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on ``root`` (its pyproject.toml, its packages first on sys.path)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))")
    return subprocess.run([sys.executable, "-c", code, str(root)], cwd=root, capture_output=True, text=True,
                          timeout=120)


def test_import_contracts_hold():
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("router/app.py", "import torch", "The router needs neither"),
    ("router/app.py", "import prefill.connector", "The router needs neither"),
    ("decode/saver.py", "import prefill.lookup", "Floors"),
    ("transport/wire.py", "import core.params", "transport is the ground floor"),
    ("kernels/blocks.py", "import core.config", "Floors"),                 # a package cycle
    ("deploy/launch.py", "import kvrelay.cli", "Nothing imports the CLI"),
])
def test_each_rule_bites(tmp_path: Path, module: str, line: str, contract: str):
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.sh", "*.yaml"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # injected by test_architecture\n")
    res = lint_imports(copy)
    assert res.returncode != 0, f"{line!r} in {module} broke no contract:\n{res.stdout}"
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken.replace("\n", " "), res.stdout


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_limit():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
