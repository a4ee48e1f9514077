"""The decode path: a decode node D emits every token; a prefill node P, if any, only pushes.

``router.first_token: decode``, and every request the split path cannot continue exactly
(:mod:`kvrelay.router.split`): P gets the request with ``max_tokens=1`` and push params in
the background, D gets the client's request with pull params at the same time and streams
its answer back unchanged. With ``tid`` empty D computes the prompt itself (no prefill
node, or a request D must judge alone). A prefill that fails (connection error or 5xx) is
retried once on another P with the same transfer id; if none is left D recomputes after
``connector.first_chunk_s``. A D that fails before the client was sent anything is replaced
by another (which computes the prompt itself); with none left the client gets a clean 502.
Mid-stream, an answer the router tracks (:class:`Tracked`, given by
:mod:`kvrelay.router.alone_path` for streams the split path could continue) goes on on
another decode node; any other ends with an OpenAI-style error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.core.params import PARAMS_REFUSED_HEADER, PullParams, PushParams
from kvrelay.router import responses, split
from kvrelay.router.job import Job
from kvrelay.router.pools import Node, NoHealthyNode, PrefillWork
from kvrelay.router.responses import error_response
from kvrelay.router.upstream import EngineClient, note_draining

log = logging.getLogger("kvrelay.router")
# Streams a decode node's open event-stream answer to the client: (job, the node, its response, headers)
# (or, a str: why the node failed before the client was sent anything, so that another is asked)
Relay = Callable[[Job, Node, aiohttp.ClientResponse, dict[str, str]], Awaitable[web.StreamResponse | str]]


@dataclass(frozen=True)
class Tracked:
    """How D's answer is tracked so another node can continue it (:mod:`kvrelay.router.alone_path`):
    the body D is asked (the client's, plus ``return_token_ids``) and the relay of its stream."""

    body: dict[str, Any]
    relay: Relay


class DecodePath:
    """The decode path over one :class:`~kvrelay.router.upstream.EngineClient`."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def prefill_and_decode(self, job: Job, p_node: Node, work: PrefillWork,
                                 tracked: Tracked | None = None) -> web.StreamResponse:
        """The decode path: P prefills and pushes (in the background), D answers the client
        (``tracked``: so that another decode node can continue the answer, see :meth:`decode`)."""
        prefill = asyncio.create_task(self._prefill(job, p_node))
        prefill.add_done_callback(work.done)
        try:
            resp = await self.decode(job, job.ids.transfer, p_node.url, tracked=tracked)
        except asyncio.CancelledError:          # client went away: abort both sides
            prefill.cancel()
            raise
        if resp.status != 200 and not prefill.done():
            prefill.cancel()                    # D refused or failed: P's prefill and push are for nothing
        if not prefill.done():
            prefill.add_done_callback(_log_task_error)
        return resp

    async def _prefill(self, job: Job, node: Node) -> None:
        pbody = split.prefill_body(job.body, token_ids=False)
        pbody["kv_transfer_params"] = self.client.signed(PushParams(transfer_id=job.ids.transfer,
                                                                    push_to=job.decode.kv_endpoint))
        tried: tuple[Node, ...] = ()
        for attempt in range(2):
            tried += (node,)
            ok, why = await self._post_prefill(node, job.endpoint, pbody, f"{job.ids.engine}-p")
            if ok:
                return
            if why == "client_error":         # D took the request P refused: D recomputes once its wait ends
                self.client.metrics.errors.labels("prefill_refused").inc()
                log.warning("prefill on %s refused the prefill of %s that its decode node took; the decode node "
                            "recomputes the prompt after connector.first_chunk_s", node.url, job.ids.client)
                return
            self.client.metrics.errors.labels("prefill_failed").inc()
            log.warning("prefill on %s failed (%s) for %s (attempt %d)", node.url, why, job.ids.client, attempt + 1)
            try:
                node = self.client.prefill.pick(exclude=tried)
            except NoHealthyNode:
                log.warning("no other prefill node; decode node recomputes the prompt of %s", job.ids.client)
                return

    async def _post_prefill(self, node: Node, endpoint: str, body: dict[str, Any], rid: str) -> tuple[bool, str]:
        assert self.client.session is not None
        node.outstanding += 1
        async def read(r: aiohttp.ClientResponse) -> tuple[bool, str]:
            await r.read()
            note_draining(node, r)
            self.client.judge(node, r.status)
            if r.status >= 500:
                return False, f"HTTP {r.status}"
            if PARAMS_REFUSED_HEADER in r.headers:    # our own params, not the client's request: another P
                self.client.metrics.errors.labels("params_refused").inc()
                return False, f"params refused ({r.headers[PARAMS_REFUSED_HEADER]})"
            return r.status == 200, "ok" if r.status == 200 else "client_error"
        try:
            return await self.client.send(f"{node.url}{endpoint}", body, rid, read)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            node.failures += 1
            self.client.judge(node, None)
            return False, type(exc).__name__
        finally:
            node.outstanding -= 1

    async def pass_through(self, job: Job, raw: bytes) -> web.StreamResponse:
        """A body that is not a JSON object goes to a decode node verbatim; its answer comes back verbatim."""
        assert self.client.session is not None
        node = job.decode
        try:
            async with self.client.session.post(f"{node.url}{job.endpoint}", data=raw, headers={
                    "Content-Type": job.request.headers.get("Content-Type", "application/json"),
                    "X-Request-Id": job.ids.engine}) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type,
                                    headers=job.ids.headers())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return error_response(502, self.client.node_failed("the decode node", node, exc),
                                  "bad_gateway", job.ids.client)

    async def decode(self, job: Job, tid: str, p_url: str, tracked: Tracked | None = None) -> web.StreamResponse:
        """D answers the client: with pull params for ``tid`` ("" = D computes the prompt itself).
        ``tracked``: what D is asked and what streams its events to the client (default: the
        client's request, streamed back verbatim by :meth:`_stream`).

        A decode node that fails before the client was sent anything (no answer, a dropped
        connection, a 5xx) is replaced by another, up to ``router.max_migrations`` times, which
        computes the prompt itself: the client gets one answer, as one vLLM gives it."""
        assert self.client.session is not None
        dbody = dict(job.body if tracked is None else tracked.body)
        relay = self._stream if tracked is None else tracked.relay
        if tid:
            dbody["kv_transfer_params"] = self.client.signed(PullParams(transfer_id=tid))
        headers = self.client.answer_headers(job, p_url)
        node, tried = job.decode, list[Node]()
        while True:
            got = await self._answer(job, node, dbody, headers, relay)
            if not isinstance(got, str):
                return got
            tried.append(node)
            node_or_none = self._another(job, tried, got)
            if node_or_none is None:
                self.client.metrics.errors.labels("decode_failed").inc()
                self.client.metrics.requests.labels(job.endpoint, "decode_failed").inc()
                return error_response(502, got, "bad_gateway", job.ids.client)
            node = node_or_none
            dbody.pop("kv_transfer_params", None)       # the push went to the failed node: compute the prompt

    def _another(self, job: Job, tried: list[Node], why: str) -> Node | None:
        """A decode node to ask again, the client having been sent nothing (None: none, or out of tries)."""
        if len(tried) > self.client.cfg.router.max_migrations:
            return None
        try:
            node = self.client.decode.pick(exclude=tuple(tried))
        except NoHealthyNode:
            return None
        self.client.metrics.errors.labels("decode_retried").inc()
        log.warning("%s: %s before the client was sent anything; asking %s", job.ids.client, why, node.url)
        return node

    async def _answer(self, job: Job, node: Node, dbody: dict[str, Any], headers: dict[str, str],
                      relay: Relay) -> web.StreamResponse | str:
        """One decode node's answer to the client, or (a str) why the node failed before the
        client was sent anything."""
        node.outstanding += 1
        try:
            node, r = await self.client.open_decode(node, job.endpoint, dbody, job.ids.engine)
            async with r:
                self.client.judge(node, r.status)
                if r.status != 200 or "text/event-stream" not in r.headers.get("Content-Type", ""):
                    data = await r.read()
                    if r.status >= 500:
                        return self.client.node_failed("the decode node", node, f"HTTP {r.status}")
                    self.client.metrics.ttft.observe(time.monotonic() - job.t0)
                    self.client.metrics.requests.labels(job.endpoint, "ok" if r.status == 200 else f"http_{r.status}").inc()
                    return web.Response(body=data, status=r.status, content_type=r.content_type, headers=headers)
                return await relay(job, node, r, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.client.judge(node, None)
            return self.client.node_failed("the decode node", node, exc)
        finally:
            node.outstanding -= 1

    async def _stream(self, job: Job, node: Node, upstream: aiohttp.ClientResponse,
                      headers: dict[str, str]) -> web.StreamResponse:
        out = await responses.open_stream(job.request, headers, self.client.cfg.router.client_write_timeout_s)
        first, tail, last = True, b"", 0.0
        try:
            async for piece in upstream.content.iter_any():
                now = time.monotonic()
                if first:
                    self.client.metrics.ttft.observe(now - job.t0)
                    first = False
                else:
                    self.client.metrics.itl.observe(now - last)
                last = now
                await responses.write(out, piece)
                tail = (tail + piece)[-64:]
            failure = "" if tail.rstrip().endswith(b"data: [DONE]") else "the decode node ended the stream early"
        except responses.ClientGone as exc:      # gone, or too slow a reader: never the node's failure
            self.client.metrics.errors.labels(responses.gone_cause(exc)).inc()
            self.client.metrics.requests.labels(job.endpoint, "client_disconnect").inc()
            return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failure = self.client.node_failed("the decode node (mid-stream)", node, exc)
        with contextlib.suppress(responses.ClientGone):
            if failure:
                self.client.metrics.errors.labels("decode_failed_midstream").inc()
                self.client.metrics.requests.labels(job.endpoint, "decode_failed").inc()
                await responses.write(out, responses.sse_error(failure, job.ids.client))
            else:
                self.client.metrics.requests.labels(job.endpoint, "ok").inc()
            await responses.end(out)
        return out


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("prefill task failed: %r", task.exception())
