"""The rooms hold: one namespace, import rules, no cycles, size limits.

* The import-linter contracts in pyproject.toml are checked on a staged tree in which
  ``kvrelay/<room>`` holds each root folder (what ``pip install`` lays out), and each rule
  is shown to bite on a copy with one forbidden import added - so a contract that silently
  stopped matching would fail here too.
* An ``ast`` walk over every module counts every import - ``TYPE_CHECKING`` blocks and
  imports inside functions included - and finds no module cycle; on a copy with one circle
  added back, it finds that circle.
* No module is over 500 lines, no class over 300, no function over 60.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ["common", "transport", "store", "kernels", "core", "prefill", "decode", "router", "deploy", "bench"]
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60

pytest.importorskip("importlinter")


def stage(src: Path, dst: Path) -> Path:
    """``dst/kvrelay/`` laid out as installed: kvrelay/*.py plus one subpackage per room."""
    pkg = dst / "kvrelay"
    ignore = shutil.ignore_patterns("__pycache__", "*.sh", "*.yaml", "*.json")
    shutil.copytree(src / "kvrelay", pkg, ignore=ignore)
    for room in ROOMS:
        shutil.copytree(src / room, pkg / room, ignore=ignore)
    shutil.copy(src / "pyproject.toml", dst)
    return dst


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on a staged ``root`` (its pyproject.toml, its kvrelay first on sys.path)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))")
    return subprocess.run([sys.executable, "-c", code, str(root)], cwd=root, capture_output=True, text=True,
                          timeout=120)


def test_import_contracts_hold(tmp_path: Path):
    res = lint_imports(stage(ROOT, tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("router/app.py", "import torch", "The router needs neither"),
    ("router/app.py", "import kvrelay.prefill.connector", "The router needs neither"),
    ("decode/saver.py", "import kvrelay.prefill.lookup", "Floors"),
    ("common/wire.py", "import kvrelay.core.params", "common is the ground floor"),
    ("store/records.py", "import kvrelay.transport.pool", "Floors"),         # store beside transport
    ("kernels/blocks.py", "import kvrelay.store.records", "The kernels move opaque blocks"),
    ("kernels/blocks.py", "import kvrelay.core.config", "Floors"),           # a package cycle
    ("deploy/launch.py", "import kvrelay.cli", "Nothing imports the CLI"),
])
def test_each_rule_bites(tmp_path: Path, module: str, line: str, contract: str):
    copy = stage(ROOT, tmp_path)
    target = copy / "kvrelay" / module
    target.write_text(target.read_text() + f"\n{line}  # injected by test_architecture\n")
    res = lint_imports(copy)
    assert res.returncode != 0, f"{line!r} in {module} broke no contract:\n{res.stdout}"
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken.replace("\n", " "), res.stdout


# ------------------------------------------------------------------ module cycles
def module_name(root: Path, path: Path) -> str:
    """``prefill/pusher.py`` -> ``kvrelay.prefill.pusher``; ``kvrelay/cli.py`` -> ``kvrelay.cli``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "kvrelay" else ["kvrelay", *parts])


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the kvrelay modules it imports anywhere in its body (``TYPE_CHECKING`` and
    function-level imports count). ``from pkg import mod`` is an edge to ``pkg.mod``."""
    files = {module_name(root, p): p for d in ["kvrelay", *ROOMS] for p in (root / d).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def test_no_module_cycle():
    found = cycles(import_graph(ROOT))
    assert not found, f"import cycles (every import counts, TYPE_CHECKING and function-level too): {found}"


@pytest.mark.parametrize("module, line, circle", [
    ("prefill/pusher.py", "if TYPE_CHECKING:\n    from kvrelay.prefill.connector import PushWorker",
     {"kvrelay.prefill.connector", "kvrelay.prefill.pusher"}),
    ("kernels/layout.py", "def _late():\n    from kvrelay.kernels import cuda",
     {"kvrelay.kernels.cuda", "kvrelay.kernels.layout"}),
])
def test_the_cycle_check_bites(tmp_path: Path, module: str, line: str, circle: set[str]):
    copy = tmp_path / "tree"
    for d in ["kvrelay", *ROOMS]:
        shutil.copytree(ROOT / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}\n")
    found = cycles(import_graph(copy))
    assert any(circle <= set(c) for c in found), found


# ------------------------------------------------------------------ sizes
def _sources() -> list[Path]:
    return sorted(p for d in ["kvrelay", *ROOMS] for p in (ROOT / d).rglob("*.py"))


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _spans(kind: type | tuple[type, ...], limit: int) -> dict[str, int]:
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, kind):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    return long


def test_no_class_is_over_the_limit():
    long = _spans(ast.ClassDef, MAX_CLASS_LINES)
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_no_function_is_over_the_limit():
    long = _spans((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# ------------------------------------------------------------------ one namespace
def test_old_top_level_names_say_where_they_went():
    """Imported from the repository root under its old name, a room refuses with the new name;
    outside it, vLLM's plugin (kvrelay.core.moved) turns "No module named" into the same advice."""
    res = subprocess.run([sys.executable, "-c", "import prefill.connector"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "import kvrelay.prefill" in res.stderr, res.stderr
    code = ("import kvrelay.core.moved as m; m.register()\n"
            "try:\n    import decode.connector\nexcept ModuleNotFoundError as e:\n    print(e)")
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert "use 'kvrelay.decode'" in res.stdout and "'kvrelay.decode.connector'" in res.stdout, res.stdout
    from kvrelay.core.moved import new_name
    assert new_name("transport.wire") == "kvrelay.common.wire"
    assert new_name("transport.store.tiers") == "kvrelay.store.tiers"
    assert new_name("transport.sender") == "kvrelay.transport.sender"
