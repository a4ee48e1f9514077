"""Operator hooks named in the config as ``"module:function"``, loaded once at start.

``connector.push_hook`` (prefill) sees each chunk before it is written (fault injection);
``connector.inspect_hook`` sees a request's KV blocks when they are complete: on a prefill rank
after the forward that computed the last prompt token, on a decode rank after the last piece was
installed. Both run on the engine's threads, so they must be quick; neither is set by default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvrelay.common.errors import KVRelayError

# (role, TP rank, request id, the KVLayout, the prompt's block ids) -> None
InspectHook = Callable[[str, int, str, Any, list[int]], None]


def load_function(spec: str, key: str) -> Any:
    """``"module:function"`` -> the function (None for ``""``); ``key`` names the config key in errors."""
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise KVRelayError(f"{key} {spec!r} cannot be loaded: {exc}") from exc
