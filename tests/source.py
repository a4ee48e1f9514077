"""Read a Python file's syntax tree in tests, robust to CPython 3.11's shared AST counter.

CPython 3.11 keeps the AST constructor's recursion depth in per-interpreter state; a parse in
another thread (a library's, a previous test's) at the same moment makes ``ast.parse`` raise
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905, fixed in
3.12). The source is fine, so the parse is simply repeated.
"""

from __future__ import annotations

import ast
from pathlib import Path

TRIES = 5


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``'s text, retried on the 3.11 recursion-depth ``SystemError``."""
    text = path.read_text()
    for attempt in range(TRIES):
        try:
            return ast.parse(text, filename=str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == TRIES - 1:
                raise
    raise AssertionError("unreachable")
