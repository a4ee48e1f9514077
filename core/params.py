"""The ``kv_transfer_params`` schema: what the router puts into both requests of a PD pair.

``{"kvrelay": {...}}`` carries :class:`PushParams` to the prefill node and
:class:`PullParams` to the decode node. Versioned and validated: anything else is a
:class:`ParamsError` naming what is wrong.
"""

from __future__ import annotations

from typing import Any

import msgspec

from transport.errors import KVRelayError

PARAMS_KEY = "kvrelay"
PARAMS_VERSION = 1


class ParamsError(KVRelayError, ValueError):
    """Malformed ``kv_transfer_params``."""


class PushParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="push", tag_field="role"):
    """For the prefill node: compute the prompt and push its chunks to ``push_to``."""

    transfer_id: str
    push_to: str                 # the decode node's transfer control endpoint, tcp://host:port
    v: int = PARAMS_VERSION


class PullParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="pull", tag_field="role"):
    """For the decode node: the prompt's KV arrives from a prefill node under ``transfer_id``."""

    transfer_id: str
    pull_from: str = ""          # informational: the prefill node's URL
    v: int = PARAMS_VERSION


Params = PushParams | PullParams


def parse_params(kv_transfer_params: dict[str, Any] | None) -> Params | None:
    """Extract kvrelay's params from a request's ``kv_transfer_params`` (None if absent)."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    try:
        params = msgspec.convert(kv_transfer_params[PARAMS_KEY], Params)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"invalid kv_transfer_params.{PARAMS_KEY}: {exc}") from exc
    if params.v != PARAMS_VERSION:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} version {params.v}; this node speaks "
                          f"{PARAMS_VERSION}")
    if not params.transfer_id:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.transfer_id is empty")
    return params


def params_dict(params: Params) -> dict[str, Any]:
    return {PARAMS_KEY: msgspec.to_builtins(params)}
