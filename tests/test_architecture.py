"""The rooms hold: one namespace, import rules, no cycles, size limits.

* The import-linter contracts in pyproject.toml hold on the tree (``kvrelay/<room>`` is a
  link to each root folder), and each rule is shown to bite on a copy with one forbidden
  import added - so a contract that silently stopped matching would fail here too.
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

from tests.source import parse

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ["common", "transport", "store", "kernels", "core", "prefill", "decode", "router", "deploy", "bench"]
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60

pytest.importorskip("importlinter")


def stage(src: Path, dst: Path) -> Path:
    """A copy of the package tree to plant a forbidden import in: the root folders, ``kvrelay/``
    with its links to them (kept as links), and pyproject.toml."""
    ignore = shutil.ignore_patterns("__pycache__", "*.sh", "*.yaml", "*.json")
    for d in ["kvrelay", *ROOMS]:
        shutil.copytree(src / d, dst / d, symlinks=True, ignore=ignore)
    shutil.copy(src / "pyproject.toml", dst)
    return dst


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the tree at ``root`` (its pyproject.toml, its kvrelay first on sys.path)."""
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
    target = copy / module
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
        for node in ast.walk(parse(path)):
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
        for node in ast.walk(parse(p)):
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
def test_the_package_is_the_root_folders_linked_and_imports_without_an_install(tmp_path: Path):
    """``kvrelay/<room>`` is a link to the root folder ``<room>``, so a fresh clone imports
    ``kvrelay.*`` from its root as plain files: no install, no import hook, no name guard."""
    for room in ROOMS:
        link = ROOT / "kvrelay" / room
        assert link.is_symlink() and link.resolve() == (ROOT / room).resolve(), f"kvrelay/{room}"
        assert "__name__ !=" not in (ROOT / room / "__init__.py").read_text(), f"{room}/__init__.py has a guard"
    clone = stage(ROOT, tmp_path / "clone")
    code = "import kvrelay.transport, kvrelay.router; print(kvrelay.transport.__file__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).is_relative_to(clone), res.stdout


def test_a_module_name_is_used_once_unless_its_twins_say_they_share_a_role():
    """Two modules of one name in two rooms must serve the same role, and each docstring says so,
    naming the others; any other repeated name is a module whose name does not say what it holds."""
    by_name: dict[str, list[Path]] = {}
    for p in _sources():
        if p.name != "__init__.py":
            by_name.setdefault(p.name, []).append(p.relative_to(ROOT))
    for paths in by_name.values():
        if len(paths) < 2:
            continue
        for p in paths:
            doc = ast.get_docstring(parse(ROOT / p)) or ""
            others = [str(o) for o in paths if o != p]
            assert "Same role as" in doc and all(f"``{o}``" in doc for o in others), \
                f"{p} shares its name with {others}: rename it, or state the shared role in both docstrings"
