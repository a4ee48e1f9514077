"""The docs are split by reader and kept current: the README is short and undated, and the code
map is the packages' own docstrings."""

from __future__ import annotations

import re
from pathlib import Path

from tests import codemap

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_map_is_the_docstrings():
    assert codemap.render() in codemap.PAGE.read_text(), "stale code map: run python -m tests.codemap"


def test_the_readme_is_short_undated_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"20\d\d-\d\d-\d\d", text), "a date in the README: it belongs in docs/lab"
    for target in re.findall(r"\]\(((?:docs|deploy)/[^)#]+)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for doc in ("guide/deploy.md", "guide/operate.md", "guide/configuration.md", "guide/compatibility.md",
                "guide/security.md", "dev/architecture.md", "dev/testing.md", "dev/benchmarks.md"):
        assert (ROOT / "docs" / doc).is_file(), doc
