"""The engine's front door: refuse forged ``kv_transfer_params`` before vLLM sees them.

vLLM loads this as API-server middleware (``--middleware core.guard.kvrelay_guard``,
which ``kvrelay serve`` / ``kvrelay up`` add for prefill and decode nodes). For every
completion or chat request that carries kvrelay params it runs :class:`ParamsVerifier`
with this node's role, secret and push allowlist, and answers a refusal with an
OpenAI-style 400, so nothing is scheduled, pushed or loaded. Refusals are counted in
``kvrelay_params_refused_total{cause}`` on the engine's own ``/metrics``.

The connectors check the same params again (a request can reach the engine by other
routes); this layer is what turns a forgery into a clear client error.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from core.config import KVRelayConfig, from_connector_extra, push_allowlist
from core.params import ParamsError, ParamsVerifier, PullParams, PushParams
from transport.secrets import load_secret

log = logging.getLogger("vllm.kvrelay")
GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions")


def verifier_for(cfg: KVRelayConfig, producer: bool) -> ParamsVerifier:
    """The verifier of a prefill (``producer``) or decode node configured by ``cfg``."""
    role = PushParams if producer else PullParams
    return ParamsVerifier(load_secret(cfg.transport), role, allowed_push=push_allowlist(cfg) if producer else None)


@functools.cache
def _refusals() -> Any:
    from prometheus_client import Counter

    return Counter("kvrelay_params_refused", "Requests refused for their kv_transfer_params", ["cause"])


def count_refusal(exc: ParamsError) -> None:
    _refusals().labels(exc.cause.value).inc()


def openai_error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError",
                 code: str | None = None) -> dict[str, Any]:
    """An error body as vLLM's and OpenAI's servers write it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def _verifier(app: Any) -> ParamsVerifier | None:
    state = app.state
    if not hasattr(state, "kvrelay_verifier"):
        kv = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
        if kv is None or kv.kv_connector_extra_config is None:
            state.kvrelay_verifier = None
        else:
            cfg = from_connector_extra(kv.kv_connector_extra_config)
            state.kvrelay_verifier = verifier_for(cfg, producer=kv.kv_role == "kv_producer")
    verifier: ParamsVerifier | None = state.kvrelay_verifier
    return verifier


async def kvrelay_guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette ``http`` middleware: 400 for a request whose kvrelay params do not verify."""
    if request.method != "POST" or request.url.path not in GUARDED_PATHS:
        return await call_next(request)
    verifier = _verifier(request.app)
    if verifier is None:
        return await call_next(request)
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return await call_next(request)             # vLLM answers malformed JSON itself
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    try:
        verifier.check(params if isinstance(params, dict) else None)
    except ParamsError as exc:
        from starlette.responses import JSONResponse

        count_refusal(exc)
        log.warning("refused a request's kv_transfer_params (%s): %s", exc.cause.value, exc)
        return JSONResponse(openai_error(400, str(exc), "kv_transfer_params"), status_code=400)
    return await call_next(request)
