"""router.first_token = prefill against scripted engines that answer in vLLM's shapes (real HTTP):
what P and D are asked, what the client gets, the fallbacks, and answers that end at token 1."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.split import fallback_reason
from tests.test_router import router_for, run

PROMPT_IDS = [5, 6, 7]
ANSWER = ["S", "M", "{", "S", "M"]            # token i's text; ids are 100 + i


class Engine:
    """P answers max_tokens=1 with token ids; D streams a token-id completion like vLLM."""

    def __init__(self, eos_at_1: bool = False) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.eos_at_1 = eos_at_1
        self.url = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            finish = "stop" if self.eos_at_1 else "length"
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                                      "token_ids": [100]}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": ANSWER[0], "refusal": None},
                          **{k: v for k, v in choice.items() if k != "index"}}
            else:
                choice.update(text=ANSWER[0], prompt_token_ids=PROMPT_IDS)
            answer = {"id": "cmpl-p", "object": "chat.completion" if chat else "text_completion", "created": 7,
                      "model": "m", "choices": [choice], "system_fingerprint": "fp",
                      "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1,
                                "prompt_tokens_details": None}}
            if chat:
                answer["prompt_token_ids"] = PROMPT_IDS
            return web.json_response(answer)
        assert body["prompt"] == PROMPT_IDS + [100] and not chat       # D continues from prompt + token 1
        n = body.get("max_tokens") or 4
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, n + 1):
            ev = {"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m",
                  "choices": [{"index": 0, "text": ANSWER[i], "logprobs": None,
                               "finish_reason": "length" if i == n else None, "stop_reason": None,
                               "prompt_token_ids": None, "token_ids": None}]}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        usage = {"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 4, "total_tokens": 4 + n, "completion_tokens": n}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


@asynccontextmanager
async def split_pair(eos_at_1: bool = False):
    from tests.test_router import serve

    p, d = Engine(eos_at_1), Engine()
    apps = []
    for e in (p, d):
        app = web.Application()
        app.router.add_get("/health", e.health)
        app.router.add_post("/v1/completions", e.handle)
        app.router.add_post("/v1/chat/completions", e.handle)
        apps.append(serve(app))
    async with apps[0] as pu, apps[1] as du:
        p.url, d.url = pu, du
        async with router_for([p], [d], first_token="prefill") as (url, _), aiohttp.ClientSession() as s:  # type: ignore[list-item]
            yield url, s, p, d


def events(raw: bytes) -> list[Any]:
    out = []
    for part in raw.split(b"\n\n"):
        if part.startswith(b"data: "):
            out.append("[DONE]" if part == b"data: [DONE]" else json.loads(part[6:]))
    return out


def test_completion_stream_token_1_from_p_then_d_with_usage():
    async def go():
        async with split_pair() as (url, s, p, d):
            body = {"model": "m", "prompt": "abc", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                evs = events(await r.read())
            (_, pb), (_, db) = p.requests[0], d.requests[0]
            assert pb["max_tokens"] == 1 and pb["return_token_ids"] and not pb["stream"]
            assert pb["kv_transfer_params"]["kvrelay"]["early"] is True
            assert db["max_tokens"] == 4 and db["kv_transfer_params"]["kvrelay"]["tail"] == 1
            return evs
    evs = run(go())
    assert [e["choices"][0]["text"] for e in evs[:5]] == ANSWER
    assert {e["id"] for e in evs[:-1]} == {"cmpl-p"} and {e["created"] for e in evs[:-1]} == {7}
    assert evs[4]["choices"][0]["finish_reason"] == "length" and "system_fingerprint" not in evs[4]
    assert evs[5]["choices"] == [] and evs[5]["usage"] == {"prompt_tokens": 3, "total_tokens": 8,
                                                           "completion_tokens": 5}
    assert evs[5]["system_fingerprint"] == "fp" and evs[-1] == "[DONE]"
    assert list(evs[0]["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                          "prompt_token_ids", "token_ids"]


def test_chat_stream_starts_with_the_role_and_non_stream_merges():
    async def go():
        async with split_pair() as (url, s, p, d):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                    "stream": True}
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                streamed = events(await r.read())
            async with s.post(f"{url}/v1/chat/completions", json={**body, "stream": False}) as r:
                whole = await r.json()
            return streamed, whole, d.requests
    streamed, whole, d_reqs = run(go())
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in streamed[1:4]] == ANSWER[:3]
    assert all(e["object"] == "chat.completion.chunk" for e in streamed[:-1])
    assert streamed[3]["choices"][0]["finish_reason"] == "length" and streamed[3]["system_fingerprint"] == "fp"
    assert d_reqs[0][0] == "/v1/completions" and d_reqs[0][1]["max_tokens"] == 2
    assert whole["choices"][0]["message"]["content"] == "".join(ANSWER[:3])
    assert whole["usage"]["completion_tokens"] == 3 and whole["usage"]["prompt_tokens"] == 3
    assert whole["prompt_token_ids"] is None and whole["choices"][0]["token_ids"] is None


def test_an_answer_that_ends_at_token_1_never_touches_d():
    async def go():
        async with split_pair(eos_at_1=True) as (url, s, p, d):
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
                evs = events(await r.read())
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}) as r:
                one = await r.json()
            return evs, one, p.requests, d.requests
    evs, one, p_reqs, d_reqs = run(go())
    assert d_reqs == []
    assert evs[0]["choices"][0]["finish_reason"] == "stop" and evs[-1] == "[DONE]"
    assert one["choices"][0]["text"] == "S" and one["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" not in p_reqs[1][1]              # max_tokens=1: nothing is pushed at all


def test_feature_off_values_still_split():
    # vLLM's serving benchmark sends repetition_penalty 1.0 and logprobs null with every request:
    # those (and SDKs' zero penalties, n 1, empty stop lists) must not force the decode path
    c = "/v1/completions"
    bench = {"prompt": "x", "repetition_penalty": 1.0, "logprobs": None, "max_tokens": 8, "stream": True,
             "ignore_eos": True, "stream_options": {"include_usage": True}}
    assert fallback_reason(c, bench) is None
    for key, value in (("presence_penalty", 0), ("frequency_penalty", 0.0), ("n", 1), ("echo", False),
                       ("stop", []), ("min_tokens", 0), ("stop_token_ids", [])):
        assert fallback_reason(c, {"prompt": "x", key: value}) is None, key
    for key, value in (("repetition_penalty", 1.1), ("n", True), ("n", 2), ("echo", 0), ("stop", ["a"]),
                       ("logprobs", 0)):
        assert fallback_reason(c, {"prompt": "x", key: value}) is not None, (key, value)
    assert fallback_reason(c, {"prompt": "x", "stream_options": {"continuous_usage_stats": False}}) is None
    assert fallback_reason(c, {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}) is not None


@pytest.mark.parametrize("field,value", [("logprobs", 1), ("echo", True), ("stop", ["\n"]), ("seed", 3),
                                         ("presence_penalty", 0.5), ("response_format", {"type": "json_object"}),
                                         ("min_tokens", 2), ("return_token_ids", True), ("suffix", "x")])
def test_features_that_cannot_be_split_take_the_decode_path(field, value):
    assert fallback_reason("/v1/completions", {"prompt": "x", field: value}) is not None
    assert fallback_reason("/v1/completions", {"prompt": "x", "temperature": 0.7, "top_k": 5}) is None
    assert fallback_reason("/v1/chat/completions", {"messages": [], "tools": [{}]}) is not None

    async def go():
        async with split_pair() as (url, s, p, d):
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", field: value}) as r:
                await r.read()
            return p.requests, d.requests
    p_reqs, d_reqs = run(go())
    assert "return_token_ids" not in p_reqs[0][1] or field == "return_token_ids"
    assert d_reqs[0][1].get("prompt") == "x"                     # D got the client's own request
