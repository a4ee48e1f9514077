"""The router's front door for ``/v1``: who may ask, how often, how much at once, how large.

Runs as aiohttp middleware before any handler reads a body: the API key (401), the per-key
rate limit (429 + ``Retry-After``), the per-client limit on open requests (429,
``router.max_inflight_per_client``) and the body size (413). Each refusal is an OpenAI-style
error body and a count in ``kvrelay_router_client_errors_total{cause}``. Admission by capacity comes
after the body is read (:class:`kvrelay.router.limits.Admission`, in the completions handler).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvrelay.core.router_config import RouterConfig
from kvrelay.router.limits import ApiKeys, ClientSlots, RateLimits
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.responses import error_response, too_many


class Gate:
    """Keys, rates, open requests per client and body size, for every ``/v1`` request."""

    def __init__(self, rc: RouterConfig, metrics: RouterMetrics) -> None:
        self.rc, self.metrics = rc, metrics
        self.keys = ApiKeys.from_config(rc)
        self.rates = RateLimits(rc.rate_limit_rps, rc.rate_limit_burst)
        self.client_slots = ClientSlots(rc.max_inflight_per_client)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        who = request.remote or "?"
        if self.keys.enabled:
            key = self.keys.check(request.headers.get("Authorization"))
            if key is None:
                self.metrics.errors.labels("unauthorized").inc()
                return error_response(401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                                      "invalid_request_error", code="invalid_api_key")
            who = key
        wait = self.rates.take(who)
        if wait:
            self.metrics.errors.labels("rate_limited").inc()
            return too_many("rate limit exceeded for this API key", wait)
        if not self.client_slots.take(who):
            self.metrics.errors.labels("client_inflight_limit").inc()
            return too_many(f"this client already has {self.client_slots.limit} requests open "
                            "(router.max_inflight_per_client)", 1.0)
        try:
            return await self._sized(request, handler)
        finally:
            self.client_slots.give(who)

    async def _sized(self, request: web.Request, handler: Any) -> web.StreamResponse:
        limit = int(self.rc.max_body_bytes)
        if request.content_length is not None and request.content_length > limit:
            self.metrics.errors.labels("body_too_large").inc()
            return error_response(413, f"request body of {request.content_length} bytes exceeds the limit of "
                                  f"{limit} bytes (router.max_body_bytes)", code="request_too_large")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:        # a chunked body that turned out too large
            self.metrics.errors.labels("body_too_large").inc()
            return error_response(413, f"request body exceeds the limit of {limit} bytes (router.max_body_bytes)",
                                  code="request_too_large")
