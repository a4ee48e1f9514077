"""router.first_token = prefill against scripted engines that answer in vLLM's shapes (real HTTP):
what P and D are asked, what the client gets, the fallbacks, and answers that end at token 1."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvrelay.router.split import fallback_reason
from tests.router.test_router import router_for, run

PROMPT_IDS = [5, 6, 7]
ANSWER = ["S", "M", "{", "S", "M"] + [f"<{i}>" for i in range(5, 200)]   # token i's text; ids are 100 + i
CONTEXT = 64                                   # the scripted engines' max_model_len


class Scripted:
    """What every scripted engine answers besides completions: ``/v1/models`` and ``/health``."""

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": CONTEXT}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})


class Engine(Scripted):
    """P answers max_tokens=1 with token ids; D streams a token-id completion like vLLM."""

    def __init__(self, eos_at_1: bool = False, parser: bool = False) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.headers: list[dict[str, str]] = []
        self.eos_at_1 = eos_at_1
        self.parser = parser             # a reasoning parser: token 1 lands in reasoning_content
        self.slow = False                # D writes a token every 50 ms
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            finish = "stop" if self.eos_at_1 else "length"
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                                      "token_ids": [100]}
            if chat:
                message = {"role": "assistant", "content": ANSWER[0], "refusal": None}
                if self.parser:
                    message.update(content=None, reasoning_content=ANSWER[0])
                choice = {"index": 0, "message": message, **{k: v for k, v in choice.items() if k != "index"}}
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
        n = body.get("max_tokens") or 16                             # vLLM's completion default
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, n + 1):
            if self.slow:
                await asyncio.sleep(0.05)
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
async def split_pair(eos_at_1: bool = False, parser: bool = False, **router: object):
    from tests.router.test_router import serve

    p, d = Engine(eos_at_1, parser), Engine()
    apps = []
    for e in (p, d):
        app = web.Application()
        app.router.add_get("/health", e.health)
        app.router.add_get("/v1/models", e.models)
        app.router.add_post("/v1/completions", e.handle)
        app.router.add_post("/v1/chat/completions", e.handle)
        apps.append(serve(app))
    async with apps[0] as pu, apps[1] as du:
        p.url, d.url = pu, du
        async with router_for([p], [d], first_token="prefill", **router) as (url, _), aiohttp.ClientSession() as s:  # type: ignore[list-item]
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
    assert [e["choices"][0]["text"] for e in evs[:5]] == ANSWER[:5]
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


def _split_once(path: str, body: dict, headers: dict | None = None, **pair: Any) -> tuple[Any, list, list, Any]:
    async def go():
        async with split_pair(**pair) as (url, s, p, d):
            async with s.post(f"{url}{path}", json={"model": "m", **body}, headers=headers or {}) as r:
                raw = await r.read()
                answer = json.loads(raw) if not body.get("stream") else events(raw)
            return answer, p.requests, d.requests, (p.headers, d.headers, r.headers)
    return run(go())


def test_no_budget_completion_gets_vllms_default_of_16_tokens():
    """A completion without max_tokens: D gets 15 (16 less token 1), not its own default of 16."""
    answer, _p, d_reqs, _h = _split_once("/v1/completions", {"prompt": "abc"})
    assert d_reqs[0][1]["max_tokens"] == 15
    assert answer["choices"][0]["text"] == "".join(ANSWER[:16]) and answer["usage"]["completion_tokens"] == 16


def test_no_budget_chat_runs_to_the_context_limit():
    """A chat without a budget runs to max_model_len as in one vLLM: D gets limit - (prompt + 1)."""
    answer, _p, d_reqs, _h = _split_once("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "stream": True})
    assert d_reqs[0][1]["max_tokens"] == CONTEXT - len(PROMPT_IDS) - 1
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in answer[:-1] if e["choices"])
    assert text == "".join(ANSWER[:CONTEXT - len(PROMPT_IDS)])


def test_a_long_request_id_never_becomes_a_transfer_id():
    """A 300-character X-Request-Id is echoed; the transfer id and the engines' ids are the router's own."""
    rid = "r" * 300
    _answer, p_reqs, d_reqs, (p_h, d_h, resp_h) = _split_once("/v1/completions", {"prompt": "abc", "max_tokens": 3},
                                                             {"X-Request-Id": rid})
    tid = p_reqs[0][1]["kv_transfer_params"]["kvrelay"]["transfer_id"]
    assert tid == d_reqs[0][1]["kv_transfer_params"]["kvrelay"]["transfer_id"]
    assert tid.startswith("kvr-") and len(tid) <= 64 and rid not in tid
    assert rid not in p_h[0]["x-request-id"] and rid not in d_h[0]["x-request-id"]
    assert resp_h["X-Request-Id"] == rid


def test_a_reasoning_parsers_answer_falls_back_to_the_decode_path():
    """P's chat answer with content None (a reasoning parser took token 1): D decodes the client's
    own request from the push, and the client never sees content: null or a 500."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    _answer, p_reqs, d_reqs, _h = _split_once("/v1/chat/completions", body, parser=True)
    assert d_reqs[0][0] == "/v1/chat/completions" and d_reqs[0][1]["messages"] == body["messages"]
    assert d_reqs[0][1]["kv_transfer_params"]["kvrelay"]["role"] == "pull"


def test_chat_is_not_split_when_the_engines_run_a_parser():
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    _answer, p_reqs, d_reqs, _h = _split_once("/v1/chat/completions", body, chat_parsers=True)
    assert p_reqs[0][1]["max_tokens"] == 1 and "return_token_ids" not in p_reqs[0][1]      # the decode path
    assert d_reqs[0][1]["messages"] == body["messages"]


def test_client_kv_transfer_params_never_reach_an_engine():
    forged = {"kvrelay": {"role": "push", "transfer_id": "x", "push_to": "tcp://evil:1"}}
    for budget in (1, 5):
        _a, p_reqs, d_reqs, _h = _split_once("/v1/completions", {"prompt": "abc", "max_tokens": budget,
                                                                 "kv_transfer_params": forged})
        for _path, sent in p_reqs + d_reqs:
            assert sent.get("kv_transfer_params", {}).get("kvrelay", {}).get("push_to") != "tcp://evil:1"
        assert budget != 1 or "kv_transfer_params" not in p_reqs[0][1]


def test_a_client_that_leaves_mid_split_is_its_own_outcome():
    async def go():
        async with split_pair() as (url, s, p, d):
            d.slow = True
            r = await s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 60,
                                                             "stream": True})
            await r.content.readline()
            r.close()                                   # the client goes away after token 1
            await asyncio.sleep(0.6)
            async with s.get(f"{url}/metrics") as m:
                return await m.text()
    text = run(go())
    assert 'kvrelay_router_client_errors_total{cause="client_disconnect",model_name="kvrelay-tiny"} 1.0' in text
    assert "decode_failed" not in text
