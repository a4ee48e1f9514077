"""What the router writes to clients itself: OpenAI-style error bodies and SSE streams.

One place builds each shape, so every path (the gate, the split path, the decode path)
answers alike:

* :func:`error_response` - a JSON error body ``{"error": {message, type, param, code}}``;
* :func:`too_many` - a 429 with ``Retry-After``;
* :func:`sse_error` - an error event followed by ``data: [DONE]`` (a stream never just stops);
* :func:`open_stream` - a prepared ``text/event-stream`` response;
* :func:`client_gone` - whether an exception means the *client* went away (its outcome is
  ``client_disconnect``, never a node failure).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web


def error_body(message: str, etype: str, code: str | int) -> dict[str, dict[str, object]]:
    """OpenAI's error object: ``{"error": {message, type, param, code}}`` (the one place it is built)."""
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def error_response(status: int, message: str, etype: str = "invalid_request_error",
                   rid: str = "", headers: dict[str, str] | None = None, code: str | int | None = None) -> web.Response:
    body = error_body(message, etype, code or status)
    hdrs = {"X-Request-Id": rid} if rid else {}
    return web.json_response(body, status=status, headers={**hdrs, **(headers or {})})


def too_many(message: str, retry_after_s: float) -> web.Response:
    return error_response(429, message, "rate_limit_exceeded",
                          headers={"Retry-After": str(max(1, round(retry_after_s)))})


def sse_error(message: str, rid: str) -> bytes:
    """An OpenAI-style error event, then the end of the stream."""
    body = error_body(f"{message} (request {rid})", "bad_gateway", 502)
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def open_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **headers})
    await out.prepare(request)
    return out


class ClientGone(Exception):
    """Writing to the client failed: it disconnected (raised from :func:`write`)."""


async def write(out: web.StreamResponse, data: bytes) -> None:
    """Write to the client; a closed client connection becomes :class:`ClientGone`, so callers
    never mistake it for the upstream node failing."""
    try:
        await out.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
        raise ClientGone(str(exc)) from exc


def client_gone(exc: BaseException) -> bool:
    return isinstance(exc, ClientGone | asyncio.CancelledError)
