"""Losing a node, against scripted engines (real HTTP) and the breaker's state machine on a fake clock:
a decode node that dies mid-answer hands the rest to another with no duplicate or missing token;
a failed prefill node is replaced, then the decode node serves alone; the breaker opens,
backs off and half-opens. The same on real vLLM engines: tests/e2e/test_node_loss.py."""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvrelay.core.params import PARAMS_REFUSED_HEADER
from kvrelay.router.breaker import Breaker, BreakerState
from kvrelay.router.migration import Cause, Progress, resume_body
from tests.router.test_router import router_for, run, serve
from tests.router.test_split import PROMPT_IDS, Scripted, events


def text_of(i: int) -> str:
    return f"<{i}>"          # the text of answer token i (its id is 100 + i); token 0 comes from P


class Decoder(Scripted):
    """A decode node continuing ``PROMPT_IDS + [100]`` (+ tokens so far) deterministically: token i
    is 100 + i, whatever node computes it. ``die_after``: it drops the connection after that many
    tokens of a request (or answers ``status`` before any)."""

    def __init__(self, die_after: int | None = None, status: int = 200, eos_at: int | None = None,
                 silent_after: int | None = None) -> None:
        self.die_after, self.status, self.eos_at, self.silent_after = die_after, status, eos_at, silent_after
        self.wake = asyncio.Event()                      # ends a silence (set by the test when done)
        self.prompts: list[list[int]] = []
        self.alone = 0                                   # requests it served alone (no prefill node)
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):                       # P: token 1; or the client's own request, served alone
            if self.status != 200:
                return web.json_response({"error": {"message": "boom"}}, status=self.status)
            answer = _first_token_answer()
            if body["max_tokens"] > 1:
                self.alone += 1
                answer["choices"][0]["text"] = "".join(text_of(i) for i in range(body["max_tokens"]))
            return web.json_response(answer)
        chat = request.path.endswith("/chat/completions")
        own = chat or isinstance(body["prompt"], str)    # the client's own request, streamed by D alone
        prompt = PROMPT_IDS if own else body["prompt"]
        self.prompts.append(prompt)
        self.alone += own
        if self.status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=self.status)
        start = len(prompt) - len(PROMPT_IDS)            # the answer's next token index
        assert prompt == PROMPT_IDS + [100 + i for i in range(start)] and body["return_token_ids"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body.get("max_completion_tokens") or body["max_tokens"]
        if chat:                                         # vLLM's role event, the prompt's ids on it
            await resp.write(_sse({"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 8, "model": "m",
                                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}],
                                   "prompt_token_ids": PROMPT_IDS, "prompt_text": None}))
        for k, i in enumerate(range(start, start + n)):
            if self.die_after is not None and k == self.die_after:
                assert request.transport is not None
                request.transport.abort()                # SIGKILL-like: the connection just drops
                return resp
            if self.silent_after is not None and k == self.silent_after:
                await self.wake.wait()                   # hung: the connection open, nothing more sent
                return resp
            eos = i == self.eos_at
            finish = "stop" if eos else "length" if k == n - 1 else None
            if chat:
                ev = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 8, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": text_of(i)}, "logprobs": None,
                                   "finish_reason": finish, **({"stop_reason": None} if finish else {}),
                                   "token_ids": [100 + i]}]}
            else:
                ev = {"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m",
                      "choices": [{"index": 0, "text": text_of(i), "logprobs": None, "finish_reason": finish,
                                   "stop_reason": None, "prompt_token_ids": PROMPT_IDS if own and k == 0 else None,
                                   "token_ids": [100 + i]}]}
            await resp.write(_sse(ev))
            if eos:                                      # EOS, then the node dies before usage and [DONE]
                assert request.transport is not None
                request.transport.abort()
                return resp
        usage = {"id": "chatcmpl-d" if chat else "cmpl-d", "object": "chat.completion.chunk" if chat else
                 "text_completion", "created": 8, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n, "completion_tokens": n}}
        await resp.write(_sse(usage) + b"data: [DONE]\n\n")
        return resp


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _first_token_answer() -> dict[str, Any]:
    return {"id": "cmpl-p", "object": "text_completion", "created": 7, "model": "m", "system_fingerprint": "fp",
            "choices": [{"index": 0, "text": text_of(0), "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "token_ids": [100], "prompt_token_ids": PROMPT_IDS}],
            "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}}


class DeadPrefill(Decoder):
    """A prefill node whose requests fail: 500, or a dropped connection."""

    def __init__(self, status: int = 500) -> None:
        super().__init__(status=status)
        self.asked = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.asked += 1
        if self.status == 0:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        headers = {PARAMS_REFUSED_HEADER: "not_allowed"} if self.status == 400 else {}
        return web.json_response({"error": {"message": "boom"}}, status=self.status, headers=headers)


class Down(Decoder):
    """A prefill node that is out of rotation (its /health says 503): decode nodes serve alone."""

    down = True

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=503)


@asynccontextmanager
async def stack(prefills: list[Decoder], decodes: list[Decoder], first_token: str = "prefill", **router: object):
    apps = []
    for e in prefills + decodes:
        app = web.Application()
        app.router.add_get("/health", e.health)
        app.router.add_get("/v1/models", e.models)
        app.router.add_post("/v1/completions", e.handle)
        app.router.add_post("/v1/chat/completions", e.handle)
        apps.append(serve(app))
    entered = [await a.__aenter__() for a in apps]
    try:
        for e, url in zip(prefills + decodes, entered, strict=True):
            e.url = url
        async with router_for(prefills, decodes, first_token=first_token, policy="round_robin",  # type: ignore[arg-type]
                              **router) as (url, r), aiohttp.ClientSession() as s:
            yield url, s, r
    finally:
        for a in reversed(apps):
            await a.__aexit__(None, None, None)


BODY = {"model": "m", "prompt": "abc", "max_tokens": 12, "temperature": 0}


def _want(n: int) -> str:
    return "".join(text_of(i) for i in range(n))


def test_a_decode_node_dying_mid_stream_hands_the_rest_to_another_without_a_gap_or_a_duplicate():
    async def go():
        dying, spare = Decoder(die_after=4), Decoder()
        async with stack([Decoder()], [dying, spare]) as (url, s, router):
            async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
                evs = events(await r.read())
            assert evs[-1] == "[DONE]"
            text = "".join(c["text"] for e in evs[:-1] if isinstance(e, dict) for c in e.get("choices", ()))
            assert text == _want(12)                                   # token 1 from P, 4 from dying, 7 from spare
            assert evs[-2]["usage"]["completion_tokens"] == 12
            assert [c["finish_reason"] for e in evs[:-1] for c in e.get("choices", ())].count("length") == 1
            assert spare.prompts == [PROMPT_IDS + [100 + i for i in range(5)]]    # prompt + every token sent
            m = router.metrics
            assert m.migrations.labels("connect")._value.get() == 1
            assert m.migrated.labels("exact")._value.get() == 1
            # not streamed: the same, in one answer
            dying.prompts.clear()
            async with s.post(f"{url}/v1/completions", json=BODY) as r:
                answer = await r.json()
            assert r.status == 200, answer
            assert answer["choices"][0]["text"] == _want(12) and answer["usage"]["completion_tokens"] == 12
    run(go())


def test_a_decode_node_that_goes_silent_mid_stream_is_a_stall_and_the_rest_moves():
    """D sends 3 tokens, then nothing while its connection stays open: after
    ``router.stall_timeout_s`` of silence the answer moves to the other node, exact and whole."""
    async def go():
        hung, spare = Decoder(silent_after=3), Decoder()
        async with stack([Decoder()], [hung, spare], stall_timeout_s=1) as (url, s, router):
            try:
                t0 = asyncio.get_running_loop().time()
                async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as r:
                    evs = events(await asyncio.wait_for(r.read(), 20))
                took = asyncio.get_running_loop().time() - t0
            finally:
                hung.wake.set()
            text = "".join(c["text"] for e in evs[:-1] if isinstance(e, dict) for c in e.get("choices", ()))
            assert evs[-1] == "[DONE]" and text == _want(12)
            assert router.metrics.migrations.labels("stall")._value.get() == 1
            assert 1 <= took < 10, took
            assert spare.prompts == [PROMPT_IDS + [100 + i for i in range(4)]]
    run(go())


def _chat_text(evs: list[Any]) -> str:
    return "".join(c["delta"].get("content") or "" for e in evs if isinstance(e, dict) for c in e.get("choices", ()))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("path", ["alone", "decode-path"])
def test_an_answer_a_decode_node_streams_itself_goes_on_elsewhere_when_the_node_dies(path, endpoint):
    """D streams the client's own request: alone (no prefill node, or decode-first's
    ``decode_only``), or on the decode path (``first_token: decode``: P only pushes). It dies
    after 4 tokens; the other decode node continues from the prompt's ids (which D returned with
    ``return_token_ids``) plus the 4 tokens sent: the client's stream, in its own format, has
    every token once, one finish and usage for the whole answer, and no token ids it did not ask
    for. (On the decode path the stream used to end with an error event.)"""
    async def go():
        dying, spare = Decoder(die_after=4), Decoder()
        chat = endpoint == "chat"
        body = ({"model": "m", "messages": [{"role": "user", "content": "abc"}], "max_completion_tokens": 12,
                 "temperature": 0} if chat else BODY)
        prefills, mode = ([Down()], "prefill") if path == "alone" else ([Decoder()], "decode")
        async with stack(prefills, [dying, spare], first_token=mode) as (url, s, router):
            async with s.post(f"{url}/v1/{'chat/' if chat else ''}completions",
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                evs = events(await r.read())
            assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
            choices = [c for e in evs[:-1] for c in e.get("choices", ())]
            text = _chat_text(evs[:-1]) if chat else "".join(c["text"] for c in choices)
            assert text == _want(12)                                   # 4 from the dying node, 8 from the spare
            assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
            assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None for c in choices)
            assert all(e.get("prompt_token_ids") is None for e in evs[:-1])
            assert {e["id"] for e in evs[:-1]} == {"chatcmpl-d" if chat else "cmpl-d"}   # one answer's events
            assert evs[-2]["usage"] == {"prompt_tokens": 3, "total_tokens": 15, "completion_tokens": 12}
            if chat:                                                   # vLLM's role event, as it sends it
                assert choices[0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}
            assert dying.alone == 1 and spare.prompts == [PROMPT_IDS + [100 + i for i in range(4)]]
            assert router.metrics.migrations.labels("connect")._value.get() == 1
            assert router.metrics.migrated.labels("exact")._value.get() == 1
    run(go())


def test_a_decode_node_that_fails_before_the_client_got_anything_is_replaced():
    """A 5xx from the first decode node, before any byte reached the client: the request is asked
    of another decode node (which computes the prompt itself); the client sees one answer and the
    router counts a fallback, no failure. With no other node left the client gets the 502."""
    async def go():
        dead, good = Decoder(status=500), Decoder()
        async with stack([Down()], [dead, good]) as (url, s, router):
            for stream in (False, True):
                async with s.post(f"{url}/v1/completions", json={**BODY, "stream": stream}) as r:
                    raw = await r.read()
                assert r.status == 200, raw
                if stream:
                    evs = events(raw)
                    assert evs[-1] == "[DONE]" and "".join(c["text"] for e in evs[:-1] for c in e["choices"]) == _want(12)
                else:
                    assert json.loads(raw)["choices"][0]["text"] == _want(12)
            assert router.metrics.errors.labels("decode_retried")._value.get() >= 1
            assert router.metrics.errors.labels("decode_failed")._value.get() == 0
        async with stack([Down()], [Decoder(status=500)]) as (url, s, router), \
                s.post(f"{url}/v1/completions", json=BODY) as r:
            assert r.status == 502 and "error" in await r.json()
    run(go())


def test_a_5xx_migrates_and_when_no_node_is_left_the_client_gets_an_error_event_and_it_is_counted():
    async def go():
        async with stack([Decoder()], [Decoder(status=500), Decoder(die_after=2)], breaker_failures=0) as (url, s, r):
            async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as resp:
                raw = await resp.read()
            evs = events(raw)
            assert evs[-1] == "[DONE]" and "error" in evs[-2]
            got = "".join(c["text"] for e in evs[:-2] for c in e.get("choices", ()))
            assert got == _want(3)                                      # what was sent stays sent, nothing twice
            assert r.metrics.migrations.labels("http_5xx")._value.get() == 1
            assert r.metrics.migrated.labels("failed")._value.get() == 1
    run(go())


def test_a_failed_prefill_node_is_replaced_and_with_none_left_the_decode_node_serves_alone():
    async def go():
        dead, good = DeadPrefill(status=0), Decoder()
        async with stack([dead, good], [Decoder()]) as (url, s, r):
            for _ in range(3):                                         # round robin: dead, good, dead
                async with s.post(f"{url}/v1/completions", json=BODY) as resp:
                    answer = await resp.json()
                assert answer["choices"][0]["text"] == _want(12)
            assert dead.asked >= 2 and r.metrics.errors.labels("prefill_failed")._value.get() == 2
        alone = Decoder()
        async with stack([DeadPrefill(status=503)], [alone]) as (url, s, r):   # the only P fails: D serves alone
            async with s.post(f"{url}/v1/completions", json=BODY) as resp:
                answer = await resp.json()
            assert answer["choices"][0]["text"] == _want(12)
            assert alone.prompts == [] and alone.alone == 1 and r.metrics.errors.labels("prefill_failed_decode_only")._value.get() == 1
    run(go())


def test_a_refusal_of_the_routers_own_params_never_reaches_the_client():
    # a prefill node whose push allowlist lacks the decode node (a rolling update): 400 + X-Kvrelay-Params-Refused
    async def go():
        for first_token in ("prefill", "decode"):
            refusing, d = DeadPrefill(status=400), Decoder()
            async with stack([refusing], [d], first_token=first_token) as (url, s, r):
                async with s.post(f"{url}/v1/completions", json=BODY) as resp:
                    answer = await resp.json()
                assert resp.status == 200 and answer["choices"][0]["text"] == _want(12), answer
                assert r.metrics.errors.labels("params_refused")._value.get() == 1
    run(go())


def test_the_breaker_takes_a_failing_node_out_backs_off_and_lets_one_probe_through():
    now = [0.0]
    opened: list[str] = []
    b = Breaker(threshold=3, base_s=2.0, max_s=5.0, clock=lambda: now[0], on_open=opened.append)
    for _ in range(2):
        b.failure("a")
    assert b.state("a") is BreakerState.CLOSED and b.allows("a")
    b.success("a")                                   # a success resets the count
    for _ in range(3):
        b.failure("a")
    assert b.state("a") is BreakerState.OPEN and not b.allows("a") and opened == ["a"]
    now[0] = 2.0
    assert b.state("a") is BreakerState.HALF_OPEN
    assert b.allows("a") and not b.allows("a")        # one probe, then wait
    b.failure("a")                                    # the probe failed: open for twice as long
    now[0] = 5.9
    assert not b.allows("a")
    now[0] = 6.0
    assert b.allows("a")
    b.failure("a")                                    # capped at max_s
    now[0] = 10.9
    assert not b.allows("a")
    now[0] = 11.0
    assert b.allows("a")
    b.success("a")
    assert b.state("a") is BreakerState.CLOSED and b.allows("a") and b.allows("a")
    assert Breaker(threshold=0).state("x") is BreakerState.CLOSED
    for _ in range(3):
        b.failure("gone")                               # a node DNS discovery then drops
    b.forget({"a"})
    assert b.state("gone") is BreakerState.CLOSED and "gone" not in b._nodes


def test_an_open_breaker_keeps_a_node_out_of_picks_while_health_still_says_yes():
    async def go():
        bad, good = Decoder(status=503), Decoder()                     # a gateway error, no drain header
        async with stack([Decoder()], [bad, good], breaker_failures=2, breaker_backoff_s=60,
                         max_migrations=1) as (url, s, r):
            for _ in range(6):
                async with s.post(f"{url}/v1/completions", json=BODY) as resp:
                    assert (await resp.json())["choices"][0]["text"] == _want(12)
            assert len(bad.prompts) == 2                               # then its breaker opened
            assert r.metrics.breaker_opens.labels(r.node_label(bad.url))._value.get() == 1
            assert bad.url not in r.node_label(bad.url)                 # no address on /metrics by default
    run(go())


def test_answers_the_engine_gives_a_request_never_open_a_breaker():
    # vLLM answers 500 (or 4xx) to some requests it cannot serve: that is the request's fault, not the
    # node's, and a client sending such requests must not take decode nodes out of rotation
    async def go():
        for first_token in ("prefill", "decode"):
            refuses = Decoder(status=500)
            async with stack([Decoder()], [refuses], first_token=first_token, breaker_failures=2,
                             max_migrations=0) as (url, s, r):
                for _ in range(5):
                    async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as resp:
                        await resp.read()
                assert r.decode.breaker.state(refuses.url).value == "closed"
                assert r.metrics.breaker_opens.labels(refuses.url)._value.get() == 0
    run(go())


def test_a_stream_that_finished_before_its_node_died_is_complete_and_never_continued():
    """D sends EOS (``finish_reason: stop``) at token 5 of a 12-token budget, then its connection
    drops before usage and ``[DONE]``: the answer ends there, with no migration and no token after
    the finish (before the fix the spare node continued it past EOS)."""
    async def go():
        dying, spare = Decoder(eos_at=5), Decoder(eos_at=5)
        async with stack([Decoder()], [dying, spare]) as (url, s, router):
            async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
                evs = events(await r.read())
            assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1] if isinstance(e, dict))
            choices = [c for e in evs[:-1] if isinstance(e, dict) for c in e.get("choices", ())]
            assert "".join(c["text"] for c in choices) == _want(6)
            assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
            assert choices[-1]["finish_reason"] == "stop"                  # nothing after the finish
            assert evs[-2]["usage"]["completion_tokens"] == 6
            assert len(dying.prompts) + len(spare.prompts) == 1             # asked once, never continued
            async with s.post(f"{url}/v1/completions", json=BODY) as r:  # not streamed: the same answer
                answer = await r.json()
            assert answer["choices"][0]["text"] == _want(6) and answer["choices"][0]["finish_reason"] == "stop"
            assert len(dying.prompts) + len(spare.prompts) == 2
            assert sum(m._value.get() for m in router.metrics.migrations.metric._metrics.values()) == 0
    run(go())


def test_progress_and_the_resumed_body():
    p = Progress()
    p.take({"choices": [{"text": "a", "token_ids": [1], "finish_reason": None}]})
    p.fail(Cause.EARLY_END, "gone")
    p.fail(Cause.CONNECT, "later")                      # the first cause stays
    assert p.cause is Cause.EARLY_END
    first = {"prompt": [9, 8], "max_tokens": 5, "kv_transfer_params": {"x": 1}, "temperature": 0}
    body = resume_body(first, p)
    assert body == {"prompt": [9, 8, 1], "max_tokens": 4, "temperature": 0}
    p.resumed()
    p.take({"choices": [], "usage": {"completion_tokens": 4}})
    assert p.decoded == 5 and not p.failure and p.migrations == 1
    p.take({"error": {"message": "x"}})
    assert p.cause is Cause.ERROR_EVENT and p.tracked
    p.take({"choices": [{"text": "b", "token_ids": None, "finish_reason": None}]})
    assert not p.tracked                                # text without its ids: no continuation can be exact


class Flood(Decoder):
    """A decode node streaming a long answer (``n`` tokens of 1 KiB text, one a millisecond);
    it records what it wrote and whether the router cut it off."""

    def __init__(self, n: int = 4000) -> None:
        super().__init__()
        self.n, self.written, self.cut = n, 0, asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(_first_token_answer())
        self.prompts.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = min(self.n, body["max_tokens"])
        try:
            for i in range(n):
                ev = {"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m",
                      "choices": [{"index": 0, "text": "x" * 1024, "logprobs": None, "stop_reason": None,
                                   "finish_reason": "length" if i == n - 1 else None, "token_ids": [7]}]}
                data = b"data: " + json.dumps(ev).encode() + b"\n\n"
                await resp.write(data)
                self.written += len(data)
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            self.cut.set()
            raise
        return resp


async def _never_reads(url: str, body: dict[str, Any]) -> socket.socket:
    """A client with a 1 KiB receive buffer that sends its request and never reads the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    raw = json.dumps(body).encode()
    await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
    return sock


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_a_client_that_never_reads_costs_only_itself(first_token):
    """Two streaming clients that never read a 4 MiB answer: before the fix the router either took
    the whole answer into its socket buffers, or (a full buffer) counted its blocked write as the
    decode node's silence - a stall, a migration, a breaker failure. Now each client is dropped
    after ``router.client_write_timeout_s``, its upstream stream is closed (the engine aborts it),
    and nothing is counted against a node; an ordinary request meanwhile is answered in full."""
    async def go() -> None:
        floods = [Flood(), Flood()]
        async with stack([Decoder()], floods, first_token=first_token, client_write_timeout_s=1,
                         stall_timeout_s=1, breaker_failures=1) as (url, s, router):
            body = {**BODY, "max_tokens": 4000, "stream": True}
            clients = [await _never_reads(url, body) for _ in floods]
            async with s.post(f"{url}/v1/completions", json={**BODY, "max_tokens": 3, "stream": False}) as r:
                assert r.status == 200                  # a third request, meanwhile
            await asyncio.wait_for(asyncio.gather(*(f.cut.wait() for f in floods)), 15)
            for f in floods:
                assert f.written < f.n * 1024, "the router took the whole answer into its buffers"
            m = router.metrics
            assert m.errors.labels("client_too_slow")._value.get() == 2
            assert sum(c._value.get() for c in m.migrations.metric._metrics.values()) == 0
            assert sum(c._value.get() for c in m.breaker_opens.metric._metrics.values()) == 0
            assert sum(len(f.prompts) for f in floods) <= 3      # never continued elsewhere
            for c in clients:
                c.close()
    run(go())
