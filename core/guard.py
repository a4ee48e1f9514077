"""The engine's front door: refuse forged ``kv_transfer_params`` before vLLM sees them.

vLLM loads this as API-server middleware (``--middleware kvrelay.core.guard.kvrelay_guard``,
which ``kvrelay serve`` / ``kvrelay up`` add for prefill and decode nodes). For every
completion or chat request that carries kvrelay params it runs :class:`ParamsVerifier`
with this node's role, secret and push allowlist, and answers a refusal with an
OpenAI-style 400 carrying ``X-Kvrelay-Params-Refused: <cause>`` (so the router knows the
refusal is its own params', never the client's request, and falls back), so nothing is
scheduled, pushed or loaded. Refusals are counted in
``kvrelay_params_refused_total{cause}`` on the engine's own ``/metrics``.

The connectors check the same params again (a request can reach the engine by other
routes); this layer is what turns a forgery into a clear client error.

It is also where a draining node (:mod:`kvrelay.core.drain`) turns work away: ``/health`` answers
503 and new requests get an OpenAI-style 503 carrying ``X-Kvrelay-Draining``, except, on a
decode node that is still DRAINING, requests with pull params (their KV is already aimed here).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvrelay.common.secrets import load_secret
from kvrelay.core.config import KVRelayConfig, from_connector_extra, push_allowlist
from kvrelay.core.drain import DRAINING_HEADER, DrainPhase, read_phase
from kvrelay.core.params import PARAMS_REFUSED_HEADER, ParamsError, ParamsVerifier, PullParams, PushParams

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


class _Node:
    """What the front door knows about its node (built once per API server, on first use)."""

    def __init__(self, verifier: ParamsVerifier, producer: bool, drain_file: str) -> None:
        self.verifier, self.producer, self.drain_file = verifier, producer, drain_file


def _node(app: Any) -> _Node | None:
    state = app.state
    if not hasattr(state, "kvrelay_node"):
        kv = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
        if kv is None or kv.kv_connector_extra_config is None:
            state.kvrelay_node = None
        else:
            cfg = from_connector_extra(kv.kv_connector_extra_config)
            producer = kv.kv_role == "kv_producer"
            state.kvrelay_node = _Node(verifier_for(cfg, producer), producer, cfg.connector.drain_file)
    node: _Node | None = state.kvrelay_node
    return node


def _unavailable(message: str, phase: DrainPhase) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(openai_error(503, message, kind="ServiceUnavailableError"), status_code=503,
                        headers={DRAINING_HEADER: phase.value})


def _drain_refusal(node: _Node, phase: DrainPhase, path: str, params: Any) -> Any:
    """The 503 a draining node answers instead of taking new work (None: let it through)."""
    if path == "/health":
        return _unavailable(f"this node is {phase.value}", phase)
    if path not in GUARDED_PATHS:
        return None
    if phase is DrainPhase.STOPPING:
        return _unavailable("this node is stopping; send the request to another node", phase)
    if node.producer:
        return _unavailable("this prefill node is draining; send the request to another node", phase)
    if not isinstance(params, dict):      # a decode node finishes the transfers already aimed at it, only
        return _unavailable("this decode node is draining and takes no new requests", phase)
    return None


async def kvrelay_guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette ``http`` middleware: 400 for a request whose kvrelay params do not verify; 503
    for new work while the node drains (:mod:`kvrelay.core.drain`)."""
    node = _node(request.app)
    if node is None:
        return await call_next(request)
    phase = read_phase(node.drain_file)
    guarded = request.method == "POST" and request.url.path in GUARDED_PATHS
    params = None
    if guarded:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return await call_next(request)             # vLLM answers malformed JSON itself
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if phase is not DrainPhase.SERVING:
        refusal = _drain_refusal(node, phase, request.url.path, params)
        if refusal is not None:
            return refusal
    if guarded:
        try:
            node.verifier.check(params if isinstance(params, dict) else None)
        except ParamsError as exc:
            from starlette.responses import JSONResponse

            count_refusal(exc)
            log.warning("refused a request's kv_transfer_params (%s): %s", exc.cause.value, exc)
            return JSONResponse(openai_error(400, str(exc), "kv_transfer_params"), status_code=400,
                                headers={PARAMS_REFUSED_HEADER: exc.cause.value})
    response = await call_next(request)
    if phase is not DrainPhase.SERVING:
        response.headers[DRAINING_HEADER] = phase.value
    return response
