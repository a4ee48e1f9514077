"""Old module paths get an error that names the new one (a vLLM general plugin).

kvrelay 0.1 installed its rooms as top-level packages (``prefill``, ``decode``, ``core``,
``transport``, ...). Everything now lives under ``kvrelay.`` - ``kvrelay.prefill.connector``,
``kvrelay.decode.connector``, ``kvrelay.core.guard``. A ``kv_transfer_config`` written for
0.1 names ``prefill.connector``; vLLM would answer "No module named 'prefill'".

Contract:

* vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins``
  entry point, before it loads the KV connector. It appends :class:`MovedModuleFinder` to
  the *end* of ``sys.meta_path``, so it only sees names nothing else could import: another
  distribution's real ``core`` or ``router`` package is never shadowed.
* For a name rooted at one of :data:`OLD_ROOTS` the finder raises ``ModuleNotFoundError``
  whose message names the new module (:func:`new_name`; Python imports ``prefill`` before
  ``prefill.connector``, so that is the root's new name) and both connectors' new paths.
  Any other name is not its business.
* Idempotent; imports nothing but the standard library.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

# Only the connectors' roots: the names a user's kv_transfer_config carries. A finder that
# raises answers ``importlib.util.find_spec`` probes too, and libraries probe generic names
# (transformers asks for Hugging Face's ``kernels``), so no other name is touched.
OLD_ROOTS = frozenset({"prefill", "decode"})
GROUND = frozenset({"errors", "keys", "wire", "secrets", "listen", "polling"})   # transport.X -> common.X


def new_name(old: str) -> str:
    """``prefill.connector`` -> ``kvrelay.prefill.connector``; ``transport.wire`` ->
    ``kvrelay.common.wire``; ``transport.store.x`` -> ``kvrelay.store.x``."""
    root, _, rest = old.partition(".")
    head, _, tail = rest.partition(".")
    if root == "transport" and head in GROUND:
        return f"kvrelay.common.{rest}"
    if root == "transport" and head == "store":
        return "kvrelay.store" + (f".{tail}" if tail else "")
    return f"kvrelay.{old}"


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Turns "no module named 'prefill'" into an error that says where it went."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname.partition(".")[0] not in OLD_ROOTS:
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: kvrelay's modules moved under the kvrelay namespace; "
            f"use {new_name(fullname)!r} (the connectors' kv_connector_module_path is now "
            f"'kvrelay.prefill.connector' or 'kvrelay.decode.connector')",
            name=fullname)


def register() -> None:
    """Install the finder once, last in ``sys.meta_path``."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
