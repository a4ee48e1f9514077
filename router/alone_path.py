"""Answers a decode node streams itself, continued on another when that node fails.

Under ``router.decode_first`` a request whose prompt a decode node's prefix cache (nearly)
holds is answered by that node alone (``decode_only``): the client's own request, streamed
back in the client's own format. On the decode path (``router.first_token: decode``) D
streams the client's request too, its prompt pushed by P: :meth:`AlonePath.tracker` gives
that path the same tracking. Here D is also asked for each piece's token ids
(``return_token_ids``), which the router takes out again - one vLLM asked without the flag
sends ``null`` in their place and, with no chat parser, the very same events - so the router
knows the prompt's ids and every token the client was given. When D fails mid-answer (the
causes :mod:`kvrelay.router.migration` moves: a dropped connection, a 5xx, an error event, an
early end, silence past ``router.stall_timeout_s``), another decode node continues from
*prompt + the tokens sent* as a token-id completion, rendered in the client's format
(:meth:`SplitPath.carry_on`): a greedy answer stays token-identical, usage counts the whole.

Tracked are the streamed requests the split path could continue (:func:`split.fallback_reason`
is None, and no reasoning or tool-call parser rewrites chat answers); the rest, and answers
that are not streamed, take the plain decode path. Either way a node that fails before the
client was sent anything is replaced by another (:meth:`DecodePath.decode`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.router import responses, split
from kvrelay.router.decode_path import DecodePath, Tracked
from kvrelay.router.job import Job
from kvrelay.router.migration import NO_ANSWER, Cause, Progress
from kvrelay.router.pools import Node
from kvrelay.router.split_path import SplitPath
from kvrelay.router.upstream import EngineClient

DONE = b"data: [DONE]\n\n"


@dataclass
class OwnStream:
    """What the router learns from D's own events as it passes them on (token ids taken out)."""

    chat: bool
    head: dict[str, Any] | None = None             # id, created, model of D's events (None: none came yet)
    prompt_ids: list[int] = field(default_factory=list)
    usage_sent: bool = False

    def take(self, event: dict[str, Any], progress: Progress) -> bytes:
        """One of D's events into ``progress``; the bytes the client gets for it (b"": none)."""
        if not progress.note(event):
            return b""
        if self.head is None:
            self.head = {k: event.get(k) for k in ("id", "created", "model")}   # vLLM's events carry all three
        self.usage_sent = self.usage_sent or bool(event.get("usage"))
        if self.chat and event.get("prompt_token_ids"):          # chat: on the role event
            self.prompt_ids, event["prompt_token_ids"] = list(event["prompt_token_ids"]), None
        for c in event.get("choices", ()):
            if not self.chat and c.get("prompt_token_ids"):      # completions: on the first piece
                self.prompt_ids, c["prompt_token_ids"] = list(c["prompt_token_ids"]), None
            ids = c.get("token_ids")
            if "token_ids" in c:                                # null, as without the flag (absent stays absent)
                c["token_ids"] = None
            text = (c["delta"].get("content") or "") if self.chat else c["text"]
            if self.chat and "role" in c["delta"] and not ids:  # the role event: no token
                continue
            progress.add(ids, text, c.get("finish_reason"), c.get("stop_reason"))
        return split.sse(event)

    def first(self, fingerprint: str | None) -> split.FirstToken:
        """The answer so far as the split path's continuation starts from: no token of P's, the
        prompt's ids, D's event head (the client's events keep their id)."""
        return split.FirstToken({**(self.head or {}), "system_fingerprint": fingerprint}, "", [], self.prompt_ids,
                                len(self.prompt_ids), None, None)


class AlonePath:
    """Answers a decode node streams itself (decode-first's ``decode_only``, and the decode
    path's), tracked so another node can take over."""

    def __init__(self, client: EngineClient, decode: DecodePath, split_path: SplitPath, parsers: bool) -> None:
        """``parsers``: the engines run a reasoning or tool-call parser (chat is then never tracked)."""
        self.client, self.decode, self.split, self.parsers = client, decode, split_path, parsers
        self.fingerprint: str | None = None          # the engines' system_fingerprint, once an answer gave it

    def trackable(self, job: Job) -> bool:
        if not job.stream or (split.kind(job.endpoint) == "chat" and self.parsers):
            return False
        return split.fallback_reason(job.endpoint, job.body) is None

    async def run(self, job: Job) -> web.StreamResponse:
        """D answers alone; tracked when it can be continued elsewhere (see the module docstring)."""
        return await self.decode.decode(job, "", "", tracked=await self.tracker(job))

    async def tracker(self, job: Job) -> Tracked | None:
        """What D is asked and what relays its stream, so that another decode node can take
        ``job``'s answer over (None: not trackable; D's stream is passed on verbatim). Used for D
        alone and for the decode path, where P only pushes (``router.first_token: decode``)."""
        if not self.trackable(job):
            return None
        limit = await self.client.context_limit(job.decode)
        if limit is None and split.needs_limit(job.endpoint, job.body):
            return None

        async def relay(job: Job, node: Node, r: aiohttp.ClientResponse,
                        headers: dict[str, str]) -> web.StreamResponse | str:
            return await self._relay(job, node, r, headers, limit)
        return Tracked({**job.body, "return_token_ids": True}, relay)

    async def _relay(self, job: Job, node: Node, r: aiohttp.ClientResponse, headers: dict[str, str],
                     limit: int | None) -> web.StreamResponse | str:
        """D's own stream to the client, token ids out; a str: D failed before the client got anything."""
        own, progress = OwnStream(split.kind(job.endpoint) == "chat"), Progress()
        out: web.StreamResponse | None = None
        try:
            out = await self._own(job, r, headers, own, progress)
        except responses.ClientGone as exc:
            return self.split.gone(job, out, exc)
        if progress.cause in NO_ANSWER:
            self.client.judge(node, None)         # the breaker hears it, as on the split path
        if own.head is None or out is None:       # nothing reached the client: the decode path asks another
            return progress.failure or "the decode node ended the stream before any event"
        if not progress.failure:
            return await self._complete(job, out, own, progress)
        if not progress.tracked or not own.prompt_ids:
            progress.cause = None                 # nothing to continue from: the client is told
        first = own.first(progress.fingerprint or self.fingerprint)
        budget = split.answer_budget(job.endpoint, job.body, len(own.prompt_ids), limit)
        writer = split.StreamWriter(job.endpoint, first, job.with_usage)
        return await self.split.carry_on(job, first, writer, split.decode_body(job.body, first, budget), out,
                                         progress, [node], headers)

    async def _own(self, job: Job, r: aiohttp.ClientResponse, headers: dict[str, str], own: OwnStream,
                   progress: Progress) -> web.StreamResponse | None:
        """Pass D's events on (the stream opened at the first); the open stream, None if none came.
        D's silence past ``router.stall_timeout_s`` once it has begun is a failure (as on the split path)."""
        out, pending, last = None, b"", time.monotonic()
        try:
            piece = await r.content.readany()
            self.client.arm_stall(r)
            while piece:
                events, pending = split.decode_events(piece, pending)
                data = b"".join(own.take(ev, progress) for ev in events)
                if data:
                    now = time.monotonic()
                    if out is None:
                        out = await responses.open_stream(job.request, headers,
                                                          self.client.cfg.router.client_write_timeout_s)
                        self.client.metrics.ttft.observe(now - job.t0)
                    else:
                        self.client.metrics.itl.observe(now - last)
                    last = now
                    await responses.write(out, data)
                if progress.failure:
                    return out
                piece = await r.content.readany()
        except asyncio.TimeoutError:
            progress.fail(Cause.STALL, "the decode node was silent too long (router.stall_timeout_s)")
        except (aiohttp.ClientError, ValueError) as exc:
            progress.fail(Cause.CONNECT, f"the decode node failed mid-stream ({type(exc).__name__})")
        if progress.finish is None:
            progress.fail(Cause.EARLY_END, "the decode node ended the stream early")
        return out

    async def _complete(self, job: Job, out: web.StreamResponse, own: OwnStream,
                        progress: Progress) -> web.StreamResponse:
        """D finished the answer (its ``[DONE]`` may have been lost with the connection: a stream
        that gave its finish reason is complete)."""
        self.fingerprint = progress.fingerprint or self.fingerprint
        self.client.metrics.requests.labels(job.endpoint, "ok").inc()
        tail = DONE
        progress.decoded = max(progress.decoded, len(progress.ids))
        if job.with_usage and not own.usage_sent:          # lost after the finish: counted as one vLLM counts
            first = own.first(progress.fingerprint)
            tail = split.StreamWriter(job.endpoint, first, True).usage(split.usage(first, progress.decoded)) + DONE
        try:
            await responses.write(out, tail)
            await responses.end(out)
        except responses.ClientGone as exc:
            return self.split.gone(job, out, exc)
        return out
