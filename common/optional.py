"""Optional dependencies, imported when a command needs them.

The core install is what the router needs; plots and progress bars come with the ``bench``
extra, spans with ``otel``. A command that needs a missing one stops with a one-line error
naming the extra (``kvrelay: ... pip install 'kvrelay[bench]'``) instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvrelay.common.errors import KVRelayError


class MissingDependency(KVRelayError):
    """An optional package a command needs is not installed; the message names the extra."""


def need(module: str, extra: str, what: str) -> ModuleType:
    """``import module``, or raise ``MissingDependency`` saying ``what`` needs it and which extra has it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependency(f"{what} needs {top}: pip install 'kvrelay[{extra}]'") from exc


def pyplot(what: str) -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or ``MissingDependency``."""
    mpl = need("matplotlib", "bench", what)
    mpl.use("Agg")
    return need("matplotlib.pyplot", "bench", what)


def progress_bar(**kw: Any) -> Any:
    """A tqdm bar, or where tqdm is missing (progress is never essential) the ``iterable`` itself
    or a bar that draws nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return kw["iterable"] if "iterable" in kw else _NoBar()
    return tqdm(**kw)


class _NoBar:
    """tqdm's surface used here, doing nothing."""

    def update(self, n: int = 1) -> None:
        """Nothing to draw."""

    def set_postfix_str(self, s: str = "") -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to draw."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
