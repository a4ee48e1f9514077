"""The split path (``router.first_token: prefill``): token 1 from P, the rest from D.

See :mod:`kvrelay.router.split` for the request and answer shapes. This module runs one request:
ask P for token 1 (with an early push to D unless token 1 may be the whole answer), write
it to the client at once, and stream D's token-id continuation in the client's format.
Anything it cannot continue exactly - P's answer lacks token ids, a parser rewrote it, a
chat request's context limit is unknown - goes the decode path instead.

D always gets an explicit budget (:func:`kvrelay.router.split.answer_budget` less token 1): the
client's, or what one vLLM would allow when the client sent none.

Losing a node: token 1 is asked of up to ``router.prefill_attempts`` prefill nodes (a failed
or refusing one is replaced, with a new transfer id); with none left, D serves the request
alone. A decode node that fails mid-answer is replaced by another, which continues from the
tokens already sent (:mod:`kvrelay.router.migration`), at most ``router.max_migrations`` times.
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
from kvrelay.router.migration import MOVABLE, NO_ANSWER, Cause, Progress, outcome, resume_body
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
        asked = await self._first_token(job, p_node)
        work.done()                                   # P answered: its prefill no longer queues others
        if asked is None:                             # no prefill node could give token 1: D serves alone
            self.client.metrics.errors.labels("prefill_failed_decode_only").inc()
            return await self.fallback.decode(job, "", "")
        p_node, tid, status, answer = asked
        if status != 200 or not isinstance(answer, dict):   # P refused the request: the client's error, as vLLM says it
            return web.json_response(answer, status=status or 502, headers=job.ids.headers())
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

    async def _first_token(self, job: Job, node: Node) -> tuple[Node, str, int, Any] | None:
        """Token 1 from a prefill node: (node, transfer id, status, answer). A node that fails (no
        answer, 5xx), drains or refuses the params is replaced by another, up to
        ``router.prefill_attempts`` nodes, each with a transfer id of its own (the failed node may
        have pushed part of the prompt under the first). None: no prefill node answered."""
        tried: list[Node] = []
        for attempt in range(self.client.cfg.router.prefill_attempts):
            tid = job.ids.transfer if attempt == 0 else f"{job.ids.transfer}-r{attempt}"
            pbody = split.prefill_body(job.body)
            if split.max_new(job.endpoint, job.body) != 1:   # token 1 may be all the answer: then nothing is pushed
                pbody["kv_transfer_params"] = self.client.signed(PushParams(transfer_id=tid,
                                                                            push_to=job.decode.kv_endpoint, early=True))
            tried.append(node)
            got = await self.client.ask(node, job.endpoint, pbody, f"{job.ids.engine}-p")
            self.client.judge(node, got.status)
            if got.status is not None and got.status < 500 and not got.params_refused:
                return node, tid, got.status, got.body       # an answer (200), or the client's own error
            cause = "params_refused" if got.params_refused else "prefill_draining" if got.draining else "prefill_failed"
            self.client.metrics.errors.labels(cause).inc()
            log.warning("token 1 of %s: prefill node %s %s", job.ids.client, node.url, cause.replace("_", " "))
            try:
                node = self.client.prefill.pick(exclude=tuple(tried))
            except NoHealthyNode:
                return None
        return None

    async def _only_token(self, job: Job, first: split.FirstToken, writer: split.StreamWriter,
                          headers: dict[str, str]) -> web.StreamResponse:
        """Token 1 is the whole answer (EOS, a stop token, a budget of 1): D is never asked."""
        self.client.metrics.requests.labels(job.endpoint, "ok").inc()
        self.client.metrics.ttft.observe(time.monotonic() - job.t0)
        if not job.stream:
            return web.json_response(split.final_answer(job.endpoint, first, "", first.finish_reason,
                                                        first.stop_reason, 0), headers=headers)
        out = await self._open(job, headers)
        with contextlib.suppress(responses.ClientGone):
            await responses.write(out, writer.opening() + writer.token(first.text, first.finish_reason, first.stop_reason)
                                  + (writer.usage(split.usage(first, 0)) if job.with_usage else b"")
                                  + b"data: [DONE]\n\n")
            await responses.end(out)
        return out

    async def _open(self, job: Job, headers: dict[str, str]) -> web.StreamResponse:
        return await responses.open_stream(job.request, headers, self.client.cfg.router.client_write_timeout_s)

    async def _continue(self, job: Job, first: split.FirstToken, writer: split.StreamWriter, dbody: dict[str, Any],
                        headers: dict[str, str]) -> web.StreamResponse:
        """Token 1 to the client (streamed at once), then D's continuation in the client's format;
        a decode node that fails mid-answer hands the rest to another (:mod:`kvrelay.router.migration`)."""
        out, progress = None, Progress()
        try:
            if job.stream:
                out = await self._open(job, headers)
                await responses.write(out, writer.opening() + writer.token(first.text))
                self.client.metrics.ttft.observe(time.monotonic() - job.t0)
            node, refused = await self._segment(job, job.decode, dbody, out, writer, progress)
        except responses.ClientGone as exc:       # gone, or too slow a reader: never the node's failure
            return self.gone(job, out, exc)
        if refused is not None:
            return refused
        return await self.carry_on(job, first, writer, dbody, out, progress, [node], headers)

    async def carry_on(self, job: Job, first: split.FirstToken, writer: split.StreamWriter, dbody: dict[str, Any],
                       out: web.StreamResponse | None, progress: Progress, tried: list[Node],
                       headers: dict[str, str]) -> web.StreamResponse:
        """After a segment of ``dbody``'s answer (``tried``: the nodes that served one): while the
        last one failed in a way another node can take over, continue there; then end the answer.
        The decode-first path (:mod:`kvrelay.router.alone_path`) enters here when the node
        that answered alone fails."""
        while progress.failure and self._left_to_continue(dbody, progress):
            nxt = self._next_node(job, tried, progress)
            if nxt is None:
                break
            body = resume_body(dbody, progress)
            progress.resumed()
            try:
                node, refused = await self._segment(job, nxt, body, out, writer, progress)
            except responses.ClientGone as exc:
                return self.gone(job, out, exc)
            if refused is not None:
                return refused
            tried.append(node)
        if progress.migrations or progress.cause in MOVABLE:
            self.client.metrics.migrated.labels(outcome(job.body, bool(progress.failure)).value).inc()
        return await self._finish_split(job, first, writer, out, progress, headers)

    def gone(self, job: Job, out: web.StreamResponse | None, exc: responses.ClientGone) -> web.StreamResponse:
        self.client.metrics.requests.labels(job.endpoint, "client_disconnect").inc()
        self.client.metrics.errors.labels(responses.gone_cause(exc)).inc()
        return out if out is not None else responses.gone_response()

    @staticmethod
    def _left_to_continue(dbody: dict[str, Any], progress: Progress) -> bool:
        """False when the failed node had already sent the whole budget: the answer is complete
        and ends for its length."""
        if len(progress.ids) < dbody["max_tokens"] or progress.cause not in MOVABLE:
            return True
        progress.failure, progress.cause, progress.finish, progress.stop = "", None, "length", None
        progress.decoded = len(progress.ids)
        return False

    def _next_node(self, job: Job, tried: list[Node], progress: Progress) -> Node | None:
        """Another decode node to continue on (None: the failure is the node's answer, attempts or nodes are out)."""
        if (progress.cause not in MOVABLE or not progress.tracked
                or progress.migrations >= self.client.cfg.router.max_migrations):
            return None
        try:
            nxt = self.client.decode.pick(exclude=tuple(tried))
        except NoHealthyNode:
            return None
        assert progress.cause is not None
        self.client.metrics.migrations.labels(progress.cause.value).inc()
        log.warning("%s: %s after %d tokens; continuing on %s", job.ids.client, progress.failure,
                    len(progress.ids) + 1, nxt.url)
        return nxt

    async def _segment(self, job: Job, node: Node, body: dict[str, Any], out: web.StreamResponse | None,
                       writer: split.StreamWriter, progress: Progress) -> tuple[Node, web.Response | None]:
        """One node's part of the continuation, into ``progress``. Returns the node that served it
        (a refused connection moves the request before it is sent) and, for a client that does
        not stream, the node's own 4xx answer to pass on."""
        node.outstanding += 1
        status: int | None = None                       # what the breaker hears (None: no answer)
        try:
            node, r = await self.client.open_decode(node, "/v1/completions", body, job.ids.engine)
            async with r:
                status = r.status
                if r.status == 200:
                    await self._relay(r, out, writer, progress)
                elif r.status < 500 and out is None and not progress.ids:
                    return node, web.Response(body=await r.read(), status=r.status, content_type="application/json",
                                              headers=self.client.answer_headers(job, ""))
                else:
                    await r.read()
                    progress.fail(Cause.HTTP_5XX if r.status >= 500 else Cause.HTTP_4XX,
                                  f"the decode node answered HTTP {r.status}")
        except asyncio.TimeoutError:
            progress.fail(Cause.STALL, "the decode node was silent too long (router.stall_timeout_s)")
        except (aiohttp.ClientError, ValueError) as exc:
            progress.fail(Cause.CONNECT, self.client.node_failed("the decode node", node, exc))
        finally:
            node.outstanding -= 1
        if progress.cause is not Cause.ERROR_EVENT:      # an error event may be the request's own: not judged
            self.client.judge(node, None if progress.cause in NO_ANSWER else status)
        return node, None

    async def _relay(self, r: aiohttp.ClientResponse, out: web.StreamResponse | None, writer: split.StreamWriter,
                     progress: Progress) -> None:
        """D's events into ``progress`` (and, streamed, into the client's format). Once D has sent
        its first piece, D's silence past ``router.stall_timeout_s`` is a failure
        (:meth:`EngineClient.arm_stall`). The deadline covers reading D only: a client slow to
        read is its own deadline's business (:func:`responses.write`), never counted as D's silence."""
        pending, last = b"", time.monotonic()
        piece = await r.content.readany()
        self.client.arm_stall(r)
        while piece:
            events, pending = split.decode_events(piece, pending)
            rendered = [writer.token(text, finish, stop) for ev in events for text, finish, stop in progress.take(ev)]
            if rendered and out is not None:   # one write per piece D sent, not per token
                now = time.monotonic()
                self.client.metrics.itl.observe(now - last)
                last = now
                await responses.write(out, b"".join(rendered))
            piece = await r.content.readany()
        if progress.finish is None:
            progress.fail(Cause.EARLY_END, "the decode node ended the stream early")

    async def _finish_split(self, job: Job, first: split.FirstToken, writer: split.StreamWriter,
                            out: web.StreamResponse | None, progress: Progress,
                            headers: dict[str, str]) -> web.StreamResponse:
        rid = job.ids.client
        if progress.failure:
            self.client.metrics.errors.labels("decode_failed").inc()
            self.client.metrics.requests.labels(job.endpoint, "decode_failed").inc()
            if out is None:
                return responses.error_response(502, f"{progress.failure} (request {rid})", "bad_gateway", rid)
            with contextlib.suppress(responses.ClientGone):
                await responses.write(out, responses.sse_error(progress.failure, rid))
                await responses.end(out)
            return out
        self.client.metrics.requests.labels(job.endpoint, "ok").inc()
        writer.fingerprint = writer.fingerprint or progress.fingerprint
        text = "".join(progress.text)
        if out is None:                           # not streamed: the first token arrives with the answer
            self.client.metrics.ttft.observe(time.monotonic() - job.t0)
            return web.json_response(split.final_answer(job.endpoint, first, text, progress.finish, progress.stop,
                                                        progress.decoded), headers=headers)
        with contextlib.suppress(responses.ClientGone):
            if job.with_usage:
                await responses.write(out, writer.usage(split.usage(first, progress.decoded)))
            await responses.write(out, b"data: [DONE]\n\n")
            await responses.end(out)
        return out
