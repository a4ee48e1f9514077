"""The split path (``router.first_token: prefill``): token 1 from P, the rest from D.

See :mod:`kvrelay.router.split` for the request and answer shapes. This module runs one request:
ask P for token 1 (with an early push to D unless token 1 may be the whole answer), write
it to the client at once, and stream D's token-id continuation in the client's format.
Anything it cannot continue exactly - P's answer lacks token ids, a parser rewrote it, a
chat request's context limit is unknown - goes the decode path instead.

D always gets an explicit budget (:func:`kvrelay.router.split.answer_budget` less token 1): the
client's, or what one vLLM would allow when the client sent none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from kvrelay.core.params import PullParams, PushParams
from kvrelay.router import responses, split
from kvrelay.router.decode_path import DecodePath
from kvrelay.router.job import Job
from kvrelay.router.pools import Node, NoHealthyNode, PrefillWork
from kvrelay.router.upstream import EngineClient

log = logging.getLogger("kvrelay.router")


class SplitPath:
    """``router.first_token: prefill`` over one engine client; what it cannot continue exactly
    goes to ``decode`` (the decode path)."""

    def __init__(self, client: EngineClient, decode: DecodePath) -> None:
        self.client, self.fallback = client, decode

    async def run(self, job: Job, p_node: Node, work: PrefillWork) -> web.StreamResponse:
        limit = await self.client.context_limit(job.decode)
        if limit is None and split.needs_limit(job.endpoint, job.body):
            self.client.metrics.errors.labels("first_token_fallback").inc()     # D alone: its own limit applies
            return await self.fallback.decode(job, "", "")
        tid = job.ids.transfer
        pbody = split.prefill_body(job.body)
        if split.max_new(job.endpoint, job.body) != 1:   # token 1 may be all the answer: then nothing is pushed
            pbody["kv_transfer_params"] = self.client.signed(PushParams(transfer_id=tid, push_to=job.decode.kv_endpoint,
                                                                  early=True))
        status, answer = await self.client.ask(p_node, job.endpoint, pbody, f"{job.ids.engine}-p")
        if status == 503 and not p_node.healthy:      # P is draining: another prefill node, if any
            with contextlib.suppress(NoHealthyNode):
                p_node = self.client.prefill.pick(exclude=(p_node,))
                status, answer = await self.client.ask(p_node, job.endpoint, pbody, f"{job.ids.engine}-p")
        work.done()                                   # P answered: its prefill no longer queues others
        if status != 200 or not isinstance(answer, dict):
            if status is not None and status < 500:   # P refused the request: the client's error, as vLLM says it
                return web.json_response(answer, status=status, headers=job.ids.headers())
            self.client.metrics.errors.labels("prefill_failed").inc()
            return await self.fallback.decode(job, "", "")
        try:
            first = split.FirstToken.parse(job.endpoint, answer)
        except (KeyError, IndexError, TypeError, ValueError) as exc:    # D decodes as usual, from the push
            log.info("prefill answer for %s cannot be continued (%r); decoding on D", job.ids.client, exc)
            self.client.metrics.errors.labels("first_token_fallback").inc()
            return await self.fallback.decode(job, tid, p_node.url)
        budget = split.answer_budget(job.endpoint, job.body, len(first.prompt_token_ids), limit)
        if budget < 1:
            # one vLLM refuses this (prompt + budget over the context): D says so, with the client's own
            # request (P's early push is dropped by D's orphan collection)
            return await self.fallback.decode(job, tid, p_node.url)
        writer = split.StreamWriter(job.endpoint, first, job.with_usage)
        headers = self.client.answer_headers(job, p_node.url)
        if first.ends_answer(budget):
            return await self._only_token(job, first, writer, headers)
        dbody = split.decode_body(job.body, first, budget)
        dbody["kv_transfer_params"] = self.client.signed(PullParams(transfer_id=tid, tail=len(first.token_ids)))
        return await self._continue(job, first, writer, dbody, headers)

    async def _only_token(self, job: Job, first: split.FirstToken, writer: split.StreamWriter,
                          headers: dict[str, str]) -> web.StreamResponse:
        """Token 1 is the whole answer (EOS, a stop token, a budget of 1): D is never asked."""
        self.client.metrics.requests.labels(job.endpoint, "ok").inc()
        self.client.metrics.ttft.observe(time.monotonic() - job.t0)
        if not job.stream:
            return web.json_response(split.final_answer(job.endpoint, first, "", first.finish_reason,
                                                        first.stop_reason, 0), headers=headers)
        out = await responses.open_stream(job.request, headers)
        await out.write(writer.opening() + writer.token(first.text, first.finish_reason, first.stop_reason)
                        + (writer.usage(split.usage(first, 0)) if job.with_usage else b"") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _continue(self, job: Job, first: split.FirstToken, writer: split.StreamWriter, dbody: dict[str, Any],
                        headers: dict[str, str]) -> web.StreamResponse:
        """Token 1 to the client (streamed at once), then D's continuation in the client's format."""
        out = None
        if job.stream:
            out = await responses.open_stream(job.request, headers)
            await responses.write(out, writer.opening() + writer.token(first.text))
            self.client.metrics.ttft.observe(time.monotonic() - job.t0)
        tail = _Tail()
        node = job.decode
        node.outstanding += 1
        try:
            node, r = await self.client.open_decode(node, "/v1/completions", dbody, job.ids.engine)
            async with r:
                if r.status != 200:
                    data = await r.read()
                    if out is None:
                        return web.Response(body=data, status=502 if r.status >= 500 else r.status,
                                            content_type="application/json", headers=headers)
                    tail.failure = f"the decode node answered HTTP {r.status}"
                else:
                    await self._relay(r, out, writer, tail)
        except responses.ClientGone:
            self.client.metrics.requests.labels(job.endpoint, "client_disconnect").inc()
            self.client.metrics.errors.labels("client_disconnect").inc()
            assert out is not None
            return out
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            tail.failure = f"the decode node failed: {type(exc).__name__}: {exc}"
        finally:
            node.outstanding -= 1
        return await self._finish_split(job, first, writer, out, tail, headers)

    async def _relay(self, r: aiohttp.ClientResponse, out: web.StreamResponse | None, writer: split.StreamWriter,
                     tail: _Tail) -> None:
        """D's events into ``tail`` (and, streamed, into the client's format)."""
        pending, last = b"", time.monotonic()
        async for piece in r.content.iter_any():
            events, pending = split.decode_events(piece, pending)
            rendered = []                 # what this piece adds to the client's stream
            for ev in events:
                if ev.get("usage"):
                    tail.decoded = int(ev["usage"]["completion_tokens"])
                for c in ev.get("choices", ()):
                    tail.text.append(c["text"])
                    tail.finish, tail.stop = c.get("finish_reason"), c.get("stop_reason")
                    if out is not None:
                        rendered.append(writer.token(c["text"], tail.finish, tail.stop))
            if rendered and out is not None:   # one write per piece D sent, not per token
                now = time.monotonic()
                self.client.metrics.itl.observe(now - last)
                last = now
                await responses.write(out, b"".join(rendered))
        if tail.finish is None:
            tail.failure = "the decode node ended the stream early"

    async def _finish_split(self, job: Job, first: split.FirstToken, writer: split.StreamWriter,
                            out: web.StreamResponse | None, tail: _Tail, headers: dict[str, str]) -> web.StreamResponse:
        rid = job.ids.client
        if tail.failure:
            self.client.metrics.errors.labels("decode_failed").inc()
            self.client.metrics.requests.labels(job.endpoint, "decode_failed").inc()
            if out is None:
                return responses.error_response(502, f"{tail.failure} (request {rid})", "bad_gateway", rid)
            with contextlib.suppress(responses.ClientGone):
                await responses.write(out, responses.sse_error(tail.failure, rid))
                await out.write_eof()
            return out
        self.client.metrics.requests.labels(job.endpoint, "ok").inc()
        text = "".join(tail.text)
        if out is None:                           # not streamed: the first token arrives with the answer
            self.client.metrics.ttft.observe(time.monotonic() - job.t0)
            return web.json_response(split.final_answer(job.endpoint, first, text, tail.finish, tail.stop,
                                                        tail.decoded), headers=headers)
        with contextlib.suppress(responses.ClientGone):
            if job.with_usage:
                await responses.write(out, writer.usage(split.usage(first, tail.decoded)))
            await responses.write(out, b"data: [DONE]\n\n")
            await out.write_eof()
        return out


class _Tail:
    """What D's continuation said: its text pieces, how it ended, how many tokens it counted."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish: str | None = None
        self.stop: Any = None
        self.decoded = 0
        self.failure = ""
