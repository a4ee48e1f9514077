"""What the router writes to clients itself: OpenAI-style error bodies and SSE streams.

One place builds each shape, so every path (the gate, the split path, the decode path)
answers alike:

* :func:`error_response` - a JSON error body ``{"error": {message, type, param, code}}``;
* :func:`too_many` - a 429 with ``Retry-After``;
* :func:`sse_error` - an error event followed by ``data: [DONE]`` (a stream never just stops);
* :func:`open_stream` - a prepared ``text/event-stream`` response (a :class:`ClientStream`);
* :func:`write` - one write to a client, with its deadline;
* :func:`client_gone` - whether an exception means the *client* went away (its outcome is
  ``client_disconnect``, never a node failure).

A slow reader costs only itself. A client stream's buffers are bounded: the event loop's
transport pauses the writer past :data:`CLIENT_BUFFER_BYTES` and the kernel's send buffer
is set to as much, so the router holds at most about 64 KiB toward a client that does not
read, and 256 KiB from its engine (:data:`kvrelay.router.upstream.UPSTREAM_RCVBUF`), not the
whole answer. A write that cannot go out within ``router.client_write_timeout_s``
(the client has read nothing for that long) drops the client (:class:`ClientTooSlow`, a
:class:`ClientGone`): the caller then closes its upstream request, which aborts it on the
engine, and counts a client disconnect - never a node failure, a migration or a breaker event.
"""

from __future__ import annotations

import asyncio
import json
import socket

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


CLIENT_BUFFER_BYTES = 16 * 1024      # per client stream: the transport's high-water mark and the socket's SO_SNDBUF
CHUNK_FRAMING = 16                   # what HTTP chunked encoding adds to a write (size line and CRLFs)


class ClientStream(web.StreamResponse):
    """An SSE response to one client: bounded buffers and a deadline on every write."""

    write_timeout_s: float | None = None

    def bound(self, request: web.Request, write_timeout_s: float | None) -> None:
        """Cap what the router and the kernel hold for this client (called once prepared)."""
        self.write_timeout_s = write_timeout_s
        transport = request.transport
        if transport is None:
            return
        transport.set_write_buffer_limits(high=CLIENT_BUFFER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_BUFFER_BYTES)
        self._client_transport = transport
        self._client_protocol = request.protocol

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes go out without waiting for the client: the writer is not
        paused and they keep the transport's buffer under its high-water mark, so the write
        neither pauses it nor waits in aiohttp's drain (which waits only while paused)."""
        transport = getattr(self, "_client_transport", None)
        protocol = getattr(self, "_client_protocol", None)
        if transport is None or protocol is None or protocol.writing_paused or transport.is_closing():
            return False
        return transport.get_write_buffer_size() + n + CHUNK_FRAMING < CLIENT_BUFFER_BYTES

    def drop(self) -> None:
        """Close the client's connection at once (nothing more can be written to it)."""
        transport = getattr(self, "_client_transport", None)
        if transport is not None:
            transport.abort()


async def open_stream(request: web.Request, headers: dict[str, str],
                      write_timeout_s: float | None = None) -> ClientStream:
    """A prepared event stream to ``request``'s client, each write due within ``write_timeout_s``."""
    out = ClientStream(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                            **headers})
    try:
        await out.prepare(request)
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone(str(exc)) from exc
    out.bound(request, write_timeout_s)
    return out


def gone_response() -> web.Response:
    """What a handler returns for a client that has gone: aiohttp's write of it fails quietly
    (a ``ConnectionError``), and its access log shows status 499, as nginx logs a client that
    closed its request."""
    return web.Response(status=499)


class ClientGone(Exception):
    """Writing to the client failed: it disconnected (raised from :func:`write`)."""


class ClientTooSlow(ClientGone):
    """The client read nothing of its stream for ``router.client_write_timeout_s``: dropped."""


async def write(out: web.StreamResponse, data: bytes) -> None:
    """Write to the client; a closed client connection becomes :class:`ClientGone`, and a
    client that does not read within its stream's deadline :class:`ClientTooSlow`, so callers
    never mistake either for the upstream node failing."""
    deadline = out.write_timeout_s if isinstance(out, ClientStream) else None
    try:
        if deadline is None or (isinstance(out, ClientStream) and out.fits(len(data))):
            await out.write(data)            # cannot wait for the client: no deadline to arm (most writes)
        else:
            async with asyncio.timeout(deadline):
                await out.write(data)
    except TimeoutError as exc:
        assert isinstance(out, ClientStream)
        out.drop()
        raise ClientTooSlow(f"the client read nothing for {deadline:g} s (router.client_write_timeout_s)") from exc
    except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
        raise ClientGone(str(exc)) from exc


def client_gone(exc: BaseException) -> bool:
    return isinstance(exc, ClientGone | asyncio.CancelledError)


async def end(out: web.StreamResponse) -> None:
    """Finish the client's stream (its last bytes under the same deadline as any write)."""
    deadline = out.write_timeout_s if isinstance(out, ClientStream) else None
    try:
        async with asyncio.timeout(deadline):
            await out.write_eof()
    except TimeoutError as exc:
        assert isinstance(out, ClientStream)
        out.drop()
        raise ClientTooSlow("the client did not read the end of its stream") from exc
    except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
        raise ClientGone(str(exc)) from exc


def gone_cause(exc: ClientGone) -> str:
    """The error label of a client that went away (``kvrelay_router_client_errors_total{cause}``)."""
    return "client_too_slow" if isinstance(exc, ClientTooSlow) else "client_disconnect"
