"""The compatibility matrix (deploy/compat.py) is the page users read, and every row's tests exist."""

from __future__ import annotations

import ast
from pathlib import Path

from kvrelay.deploy import compat
from tests.source import parse

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "compatibility.md"


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(parse(path)) if isinstance(n, ast.FunctionDef)}


def test_the_page_is_the_matrix():
    assert PAGE.read_text() == compat.markdown(), "regenerate: kvrelay compat --markdown docs/guide/compatibility.md"


def test_every_row_names_tests_that_exist():
    from tests.differential.configs import BY_NAME

    for row in compat.ROWS:
        assert row.tests, f"{row.feature}: no test"
        for ref in row.tests:
            path, _, rest = ref.partition("::")
            assert (ROOT / path).is_file(), f"{row.feature}: {path} does not exist"
            if not rest:
                continue
            func, _, param = rest.partition("[")
            assert func in _functions(ROOT / path), f"{row.feature}: {path} has no test {func}"
            if param:
                assert param.rstrip("]") in BY_NAME, f"{row.feature}: no engine case {param}"


def test_every_engine_case_has_a_row_and_refusals_have_unit_tests():
    from tests.differential.configs import CASES

    cited = {t.partition("[")[2].rstrip("]") for r in compat.ROWS for t in r.tests}
    assert {c.name for c in CASES} <= cited, "an engine case no row of the matrix cites"
    refused = [r for r in compat.ROWS if r.support is compat.Support.REFUSED]
    assert refused and all(r.proof in (compat.Proof.UNIT, compat.Proof.CI) for r in refused)
    ci = {c.name for c in CASES if c.ci}
    assert {"lora", "alternating"} <= ci, "CI runs LoRA and sliding windows (speculation, KV dtypes: refusals)"
