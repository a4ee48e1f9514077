"""Router behaviour against scripted upstream servers (real HTTP on loopback, fake engines).

The fakes only script what a vLLM server answers; everything the router does - pool
picks, concurrent P/D requests, param injection, SSE passthrough, retries, errors,
client-disconnect propagation - runs for real. The end-to-end tests in tests/e2e
cover the same router in front of real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvrelay.core import config as kcfg
from kvrelay.core.drain import DRAINING_HEADER
from kvrelay.router.app import Router
from kvrelay.router.pools import Node, Pool, check_once

_HEAD = {"id": "cmpl-f", "object": "text_completion", "created": 1, "model": "m"}


def _event(text: str, finish: str | None = None, prompt_ids: list[int] | None = None,
           ids: list[int] | None = None) -> bytes:
    """One piece of an answer as vLLM streams it (compact JSON, vLLM's key order)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "prompt_token_ids": prompt_ids, "token_ids": ids}
    return b"data: " + json.dumps({**_HEAD, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


_USAGE = b"data: " + json.dumps({**_HEAD, "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 5,
                                                                   "completion_tokens": 2}},
                                separators=(",", ":")).encode() + b"\n\n"
# An answer as vLLM streams it, without return_token_ids; with it (what the router asks a
# decode node for, to continue an answer elsewhere) each piece carries the ids instead of nulls
SSE = [_event("a"), _event("b", "length"), _USAGE, b"data: [DONE]\n\n"]
SSE_IDS = [_event("a", None, [1, 2, 3], [10]), _event("b", "length", None, [11]), _USAGE, b"data: [DONE]\n\n"]


@dataclass
class Fake:
    mode: str = "ok"                       # ok | http500 | http400 | hang | die | slow | trickle | draining | reset
    requests: list[dict] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:                     # as vLLM answers a body that is not JSON
            self.requests.append({"raw": await request.read()})
            return web.json_response({"error": {"message": "JSON decode error", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        if self.mode == "reset":               # the connection drops before any answer
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.mode == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "draining":            # kvrelay.core.guard's answer while the node drains
            return web.json_response({"error": {"message": "draining"}}, status=503,
                                     headers={DRAINING_HEADER: "draining"})
        if self.mode == "http400":
            return web.json_response({"error": {"message": "bad max_tokens"}}, status=400)
        if self.mode == "slow":                # a prefill that takes a while; is it cancelled?
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            sse = SSE_IDS if body.get("return_token_ids") else SSE
            if self.mode == "die":             # the decode node dies after one token
                await resp.write(sse[0])
                await asyncio.sleep(0.1)
                assert request.transport is not None
                request.transport.abort()
                return resp
            pieces = sse if self.mode not in ("hang", "trickle") else sse[:1] * (1000 if self.mode == "hang" else 8)
            if self.mode == "trickle":
                pieces = pieces + sse[1:]
            try:
                for piece in pieces:
                    await resp.write(piece)
                    await asyncio.sleep({"hang": 0.05, "trickle": 0.15}.get(self.mode, 0))
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "ab"}], "usage": {"prompt_tokens": 3}})


@asynccontextmanager
async def serve(app: web.Application, host: str = "127.0.0.1", port: int = 0):
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fake_node(fake: Fake, host: str = "127.0.0.1", port: int = 0):
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_post("/v1/completions", fake.complete)
    app.router.add_post("/v1/chat/completions", fake.complete)
    async with serve(app, host, port) as url:
        fake.url = url
        yield fake


@asynccontextmanager
async def router_for(prefills: list[Fake], decodes: list[Fake], policy: str = "round_robin", **router: Any):
    router.setdefault("first_token", "decode")         # these tests pin the decode path; test_split the other
    cfg = kcfg.from_dict({"router": {"policy": policy, "health_interval_s": 0.2, **router}})
    pool_p = Pool("prefill", [Node(f.url) for f in prefills], cfg.router.policy)
    pool_d = Pool("decode", [Node(f.url, f"tcp://127.0.0.1:{9100 + i}") for i, f in enumerate(decodes)],
                  cfg.router.policy)
    router = Router(cfg, pool_p, pool_d)
    async with serve(router.app()) as url:
        up = [n for n, f in zip(pool_p.nodes + pool_d.nodes, prefills + decodes, strict=True)
              if not getattr(f, "down", False)]           # a fake that says it is down never comes up
        for _ in range(50):                    # wait for the first health round
            if all(n.healthy for n in up):
                break
            await asyncio.sleep(0.05)
        yield url, router


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@asynccontextmanager
async def one_pair(p_mode: str = "ok", d_mode: str = "ok", **router: Any):
    """One scripted prefill node, one scripted decode node, the router in front, a client session."""
    pn, dn = Fake(p_mode), Fake(d_mode)
    async with fake_node(pn), fake_node(dn), router_for([pn], [dn], **router) as (url, _), \
            aiohttp.ClientSession() as s:
        yield url, s, pn, dn


async def _stack(n_p: int = 1, n_d: int = 1, p_modes: tuple[str, ...] = (), d_modes: tuple[str, ...] = ()):
    ps = [Fake(p_modes[i] if i < len(p_modes) else "ok") for i in range(n_p)]
    ds = [Fake(d_modes[i] if i < len(d_modes) else "ok") for i in range(n_d)]
    return ps, ds


def test_pd_pair_gets_params_and_sse_passes_through_unchanged():
    async def go() -> None:
        async with one_pair() as (url, s, pn, dn):
            body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "rid-1"}) as r:
                raw = await r.read()
                assert r.status == 200 and r.headers["X-Request-Id"] == "rid-1"
            assert raw == b"".join(SSE)
            await asyncio.sleep(0.1)
            p, d = pn.requests[0], dn.requests[0]
            assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
            push, pull = p["kv_transfer_params"]["kvrelay"], d["kv_transfer_params"]["kvrelay"]
            assert push["role"] == "push" and pull["role"] == "pull"
            assert push["transfer_id"] == pull["transfer_id"] and push["push_to"] == "tcp://127.0.0.1:9100"
            assert d["max_tokens"] == 5 and d["stream"] is True
            assert dn.headers[0]["X-Request-Id"] == "rid-1"
    run(go())


def test_failed_prefill_is_retried_once_on_another_node():
    async def go() -> None:
        ps, ds = await _stack(n_p=2, p_modes=("http500", "ok"))
        async with fake_node(ps[0]), fake_node(ps[1]), fake_node(ds[0]), router_for(ps, ds) as (url, router), \
                aiohttp.ClientSession() as s:
            router.prefill._rr = iter(range(10**6))  # type: ignore[assignment]  # start at node 0
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 200
            for _ in range(40):
                if ps[1].requests:
                    break
                await asyncio.sleep(0.05)
            assert len(ps[0].requests) == 1 and len(ps[1].requests) == 1
            tid = ds[0].requests[0]["kv_transfer_params"]["kvrelay"]["transfer_id"]
            assert ps[1].requests[0]["kv_transfer_params"]["kvrelay"]["transfer_id"] == tid
    run(go())


def test_decode_failure_is_a_clean_502_and_bad_json_is_judged_by_vllm():
    async def go() -> None:
        async with one_pair(d_mode="http500") as (url, s, pn, dn):
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(f"{url}/v1/chat/completions", json=chat) as r:
                body = await r.json()
                assert r.status == 502 and body["error"]["type"] == "bad_gateway"
            async with s.post(f"{url}/v1/completions", data=b"{oops") as r:   # D's own answer, verbatim
                assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"
            assert dn.requests[-1] == {"raw": b"{oops"} and len(pn.requests) == 1
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
            assert 'kvrelay_router_request_failures_total{cause="decode_failed",model_name="kvrelay-tiny"} 1.0' in text
            assert 'kvrelay_router_client_errors_total{cause="bad_request",model_name="kvrelay-tiny"} 1.0' in text
    run(go())


def test_client_disconnect_aborts_the_decode_stream():
    """... and is its own outcome: never counted as the decode node failing."""
    async def go() -> None:
        async with one_pair(d_mode="hang") as (url, s, pn, dn):
            r = await s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            await r.content.readline()
            r.close()                                   # the client goes away mid-stream
            await asyncio.wait_for(dn.disconnected.wait(), 5)
            await asyncio.sleep(0.2)
            async with s.get(f"{url}/metrics") as m:
                text = await m.text()
            assert 'kvrelay_router_client_errors_total{cause="client_disconnect",model_name="kvrelay-tiny"} 1.0' in text
            assert "decode_failed" not in text
    run(go())


def test_load_counts_stay_exact_when_a_redirected_decode_post_fails():
    """D0 drains, the request moves to D1, whose connection drops: a clean 502, and every node's
    outstanding count is back at 0 (it was -1 on D0 and +1 on D1)."""
    async def go() -> None:
        ps, ds = await _stack(n_d=2, d_modes=("draining", "reset"))
        async with fake_node(ps[0]), fake_node(ds[0]), fake_node(ds[1]), \
                router_for(ps, ds, health_interval_s=60) as (url, router), aiohttp.ClientSession() as s:
            router.decode._rr = iter(range(10**6))  # type: ignore[assignment]  # start at node 0
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 502
            await asyncio.sleep(0.1)
            assert [n.outstanding for n in router.decode.nodes + router.prefill.nodes] == [0, 0, 0]
    run(go())


def test_unhealthy_nodes_leave_rotation_and_least_outstanding_prefers_idle():
    async def go() -> None:
        ps, ds = await _stack(n_p=2)
        async with fake_node(ps[0]), fake_node(ds[0]), router_for(ps, ds, "least_outstanding") as (url, router), \
                aiohttp.ClientSession() as s:
            # ps[1] never started: the health check keeps it out; every request lands on ps[0].
            ps[1].url = "http://127.0.0.1:9"
            router.prefill.nodes[1].url = ps[1].url
            router.prefill.nodes[1].healthy = False
            for _ in range(3):
                async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                    assert r.status == 200
            await asyncio.sleep(0.2)
            assert len(ps[0].requests) == 3
            a, b = router.decode.nodes[0], Node("http://x", "tcp://x:1", healthy=True, outstanding=0)
            a.outstanding = 2
            router.decode.nodes.append(b)
            assert router.decode.pick() is b
            async with s.get(f"{url}/health") as r:
                assert r.status == 200
    run(go())


def test_a_busy_node_stays_in_rotation_until_its_health_times_out_repeatedly():
    # A real HTTP server whose /health stalls (a node busy with a long prefill on a loaded
    # host): one timeout must not take it out; `max_timeouts` in a row do. A refused
    # connection (a dead node) takes a node out at once.
    async def go() -> None:
        stall = asyncio.Event()

        async def health(request: web.Request) -> web.Response:
            if not stall.is_set():
                return web.json_response({})
            await asyncio.sleep(1.0)
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]          # type: ignore[union-attr]
        node = Node(f"http://127.0.0.1:{port}")
        try:
            async with aiohttp.ClientSession() as s:
                assert await check_once(s, node, 3, 0.2) and node.healthy
                stall.set()
                assert await check_once(s, node, 3, 0.2) and await check_once(s, node, 3, 0.2)
                assert node.timeouts == 2 and node.healthy
                assert not await check_once(s, node, 3, 0.2) and not node.healthy
                stall.clear()
                assert await check_once(s, node, 3, 0.2) and node.timeouts == 0
                dead = Node("http://127.0.0.1:9", healthy=True)
                assert not await check_once(s, dead, 3, 0.2) and not dead.healthy
        finally:
            await runner.cleanup()
    run(go())


BAD_BODIES = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "7"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": 2}, "'n'"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
]


def test_requests_vllm_must_judge_go_to_a_decode_node_alone():
    """Fields vLLM refuses itself, several sequences and lists of prompts reach D alone, without
    params: no prefill is wasted, and D answers them as one vLLM would (its own status and error)."""
    async def go() -> None:
        async with one_pair() as (url, s, pn, dn):
            for body, _field in BAD_BODIES:
                async with s.post(f"{url}/v1/completions", json={"model": "m", **body}) as r:
                    await r.read()
                assert dn.requests[-1] == {"model": "m", **body}, body        # as the client sent it
            async with s.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}) as r:
                await r.read()
            forged = {"kvrelay": {"role": "pull", "transfer_id": "x"}}
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["a", "b"],
                                                              "kv_transfer_params": forged}) as r:
                assert r.status == 200
            assert "kv_transfer_params" not in dn.requests[-1]               # a client's params never pass
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "n": 1}) as r:
                assert r.status == 200                  # one prompt as token ids is one PD request
            await asyncio.sleep(0.1)
            assert len(pn.requests) == 1 and len(dn.requests) == len(BAD_BODIES) + 3
            assert pn.requests[0]["prompt"] == [5, 6, 7]
    run(go())


def test_decode_dying_mid_stream_ends_with_an_error_event_and_done():
    """Hardening 5: never a stream that silently stops."""
    async def go() -> None:
        async with one_pair(d_mode="die") as (url, s, pn, dn):
            body = {"model": "m", "prompt": "x", "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                raw = await asyncio.wait_for(r.read(), 10)
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[0] == SSE[0].decode().strip()
            err = json.loads(events[-2].removeprefix("data: "))
            assert err["error"]["code"] == 502 and "mid-stream" in err["error"]["message"]
            assert events[-1] == "data: [DONE]"
    run(go())


def test_decode_4xx_cancels_the_prefill():
    """Hardening 4: D refuses at once, so P's prefill (and push) is cancelled, not completed."""
    async def go() -> None:
        async with one_pair(p_mode="slow", d_mode="http400") as (url, s, pn, dn):
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 400
            await asyncio.wait_for(pn.disconnected.wait(), 2)
    run(go())


def test_a_stream_longer_than_the_timeout_is_fine_while_it_keeps_talking():
    """Hardening 5: request_timeout_s bounds silence, not the length of a generation."""
    async def go() -> None:
        async with one_pair(d_mode="trickle", request_timeout_s=0.5) as (url, s, pn, dn):
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
                raw = await asyncio.wait_for(r.read(), 10)
            assert raw.endswith(b"data: [DONE]\n\n") and b"error" not in raw     # ~1.2 s of tokens
    run(go())


def test_cache_index_drops_keys_no_node_holds():
    from kvrelay.core.config import RoutingPolicy
    from kvrelay.router.cache_index import ChunkIndex
    from kvrelay.store.publisher import StoreEvent, StoreEventKind

    index = ChunkIndex(Pool("prefill", [Node("http://a"), Node("http://b")], RoutingPolicy.CACHE_AWARE), b"salt")
    keys = [bytes([i]) * 32 for i in range(3)]
    index.apply("http://a", StoreEvent(StoreEventKind.STORED, keys, b"f" * 32, 256))
    index.apply("http://b", StoreEvent(StoreEventKind.STORED, keys[:1], b"f" * 32, 256))
    index.apply("http://a", StoreEvent(StoreEventKind.EVICTED, keys, b"f" * 32, 256))
    assert set(index.holders) == {keys[0]} and index.holders[keys[0]] == {"http://b"}
    index.apply("http://b", StoreEvent(StoreEventKind.EVICTED, keys[:1], b"f" * 32, 256))
    assert not index.holders
    index.apply("http://a", StoreEvent(StoreEventKind.STORED, keys, b"f" * 32, 256))
    index.apply("http://b", StoreEvent(StoreEventKind.STORED, keys[:1], b"f" * 32, 256))
    index.forget("http://a")                                 # a node that left the pool holds nothing
    assert index.holders == {keys[0]: {"http://b"}}


def test_the_cache_index_is_bounded_and_follows_a_redeploys_fingerprint():
    """Before the fix the index was an unbounded defaultdict, and the first fingerprint it saw won
    for good: after a redeploy with new weights every new node's events were ignored forever."""
    from kvrelay.core.config import RoutingPolicy
    from kvrelay.router.cache_index import ChunkIndex
    from kvrelay.store.publisher import StoreEvent, StoreEventKind

    pool = Pool("prefill", [Node("http://old"), Node("http://new1"), Node("http://new2")], RoutingPolicy.CACHE_AWARE)
    index = ChunkIndex(pool, b"salt", max_keys=100)
    keys = [k.to_bytes(32, "big") for k in range(150)]
    index.apply("http://old", StoreEvent(StoreEventKind.STORED, keys, b"1" * 32, 256))
    assert len(index.holders) == 100 and keys[0] not in index.holders and keys[-1] in index.holders
    index.apply("http://new1", StoreEvent(StoreEventKind.STORED, keys[:5], b"2" * 32, 256))
    assert index.fingerprint == b"1" * 32 and index.holders[keys[-1]] == {"http://old"}     # a tie: kept
    index.apply("http://new2", StoreEvent(StoreEventKind.STORED, keys[:5], b"2" * 32, 256))
    assert index.fingerprint == b"2" * 32                                  # the new build is the majority
    assert index.holders == {k: {"http://new2"} for k in keys[:5]}         # the old build's keys are gone
    index.apply("http://new1", StoreEvent(StoreEventKind.STORED, keys[:3], b"2" * 32, 256))
    assert index.holders == {**{k: {"http://new1", "http://new2"} for k in keys[:3]},
                             **{k: {"http://new2"} for k in keys[3:5]}}
    index.forget("http://new1")
    index.forget("http://new2")
    index.apply("http://old", StoreEvent(StoreEventKind.STORED, keys[:1], b"1" * 32, 256))
    assert index.fingerprint == b"1" * 32 and index.holders == {keys[0]: {"http://old"}}


def test_ties_take_turns_and_the_longest_cached_prefix_wins():
    # Sequential traffic on an idle pool ties every node on load: the nodes must take turns
    # (a first-index tie-break piles every new conversation on node 0, whose engine cache
    # then holds them all); a node holding more of the prompt still wins over a tie.
    from kvrelay.core.config import RoutingPolicy
    from kvrelay.router.pools import PrefixHint

    for policy in (RoutingPolicy.CACHE_AWARE, RoutingPolicy.LEAST_OUTSTANDING):
        pool = Pool("prefill", [Node(f"http://n{i}", healthy=True) for i in range(3)], policy)
        hint = PrefixHint(1100, {f"http://n{i}": 1024 for i in range(3)}) if policy is RoutingPolicy.CACHE_AWARE else None
        assert {pool.pick(hint=hint).url for _ in range(3)} == {"http://n0", "http://n1", "http://n2"}
    pool = Pool("prefill", [Node(f"http://n{i}", healthy=True) for i in range(3)], RoutingPolicy.CACHE_AWARE)
    hint = PrefixHint(1600, {"http://n0": 1024, "http://n1": 1536, "http://n2": 1024})
    assert {pool.pick(hint=hint).url for _ in range(4)} == {"http://n1"}


def test_a_node_holding_a_shared_prefix_stops_attracting_work_once_its_queue_outweighs_it():
    # n0 holds a 1,024-token system prompt: idle, it wins every new conversation. Once the
    # prompt tokens queued on it (sent, not yet answered) exceed what its cache saves, the
    # idle nodes win - whatever the number of requests (one 4k-token prompt queues more than
    # three 40-token ones). The queue is counted from the pick until P answers.
    from kvrelay.core.config import RoutingPolicy
    from kvrelay.router.pools import PrefillWork, PrefixHint

    pool = Pool("prefill", [Node(f"http://n{i}", healthy=True) for i in range(3)], RoutingPolicy.CACHE_AWARE)
    n0 = pool.nodes[0]
    conv = PrefixHint(1100, {"http://n0": 1024})
    assert [pool.pick(hint=conv).url for _ in range(3)] == ["http://n0"] * 3
    small = [PrefillWork(n0, 40) for _ in range(3)]          # three short prompts queued on n0
    n0.outstanding = 3
    assert pool.pick(hint=conv) is n0                        # 76 + 120 < 1,100: still n0
    big = PrefillWork(n0, 3000)                              # one long prompt queued on n0
    assert pool.pick(hint=conv).url in {"http://n1", "http://n2"}
    assert pool.pick(hint=conv, load_weight=0.25) is n0      # queued tokens weigh less: n0 again
    big.done()
    big.done()                                               # idempotent: counted off once
    for w in small:
        w.done()
    assert n0.pending_tokens == 0 and pool.pick(hint=conv) is n0
    pool.nodes[0].healthy = False                            # out of rotation: never picked
    assert pool.pick(hint=conv).url in {"http://n1", "http://n2"}


def test_cache_aware_takes_the_events_endpoints_from_the_pool_it_is_given(tiny_model):
    # Pools handed to the Router directly (router.prefill empty in the config) count: a node
    # listing its events endpoint makes cache_aware valid; one without is routed by load.
    cfg = kcfg.from_dict({"router": {"policy": "cache_aware", "tokenizer": str(tiny_model)}})
    pool_p = Pool("prefill", [Node("http://127.0.0.1:1", events_endpoint="tcp://127.0.0.1:9"),
                              Node("http://127.0.0.1:2")], cfg.router.policy)
    pool_d = Pool("decode", [Node("http://127.0.0.1:3", "tcp://127.0.0.1:4")], cfg.router.policy)
    router = Router(cfg, pool_p, pool_d, secret=b"k" * 32)
    assert router.index is not None and router.index.pool is pool_p


def test_cache_aware_without_store_events_is_refused_and_kvrelay_up_assigns_them():
    # Without the prefill nodes' store events the chunk index stays empty and cache_aware
    # silently routes by load only: refuse it with the fix in the message.
    import pytest

    from kvrelay.deploy.launch import PUBLISH_OFFSET, Role, Stack

    cfg = kcfg.from_dict({"router": {"policy": "cache_aware", "tokenizer": "unused"}})
    pool_p = Pool("prefill", [Node("http://127.0.0.1:1"), Node("http://127.0.0.1:2")], cfg.router.policy)
    pool_d = Pool("decode", [Node("http://127.0.0.1:3", "tcp://127.0.0.1:4")], cfg.router.policy)
    with pytest.raises(ValueError, match="store.publish_port"):
        Router(cfg, pool_p, pool_d)
    # kvrelay up with the store on gives every prefill node a publish port and lists it for the router
    data = {"deploy": {"prefill": 2, "kv_base_port": 9100}, "router": {"policy": "cache_aware"},
            "store": {"enabled": True}, "engine": {"model": "/nonexistent"}}
    stack = Stack(kcfg.from_dict(data), log_dir="/tmp/kvrelay-test-publish")
    assert stack.cfg.store.publish_port == 9100 + PUBLISH_OFFSET
    pre = stack.router_config().router.prefill
    assert [e.split("=", 1)[1] for e in pre] == [f"tcp://127.0.0.1:{9100 + PUBLISH_OFFSET + i}" for i in range(2)]
    assert len([s for s in stack.specs if s.role is Role.PREFILL]) == 2
    for other in ({"router": {"policy": "round_robin"}}, {"store": {"enabled": False}}):
        assert Stack(kcfg.from_dict({**data, **other}), log_dir="/tmp/kvrelay-test-publish").cfg.store.publish_port == 0


def test_with_no_healthy_prefill_node_the_decode_node_serves_alone():
    async def go() -> None:
        ps, ds = await _stack()
        async with fake_node(ds[0]), router_for(ps, ds) as (url, router), aiohttp.ClientSession() as s:
            router.prefill.nodes[0].url = "http://127.0.0.1:9"          # never started: unhealthy
            router.prefill.nodes[0].healthy = False
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 200
            assert "kv_transfer_params" not in ds[0].requests[0]        # D computes the prompt itself
            async with s.get(f"{url}/metrics") as r:
                assert 'kvrelay_router_fallbacks_total{cause="no_prefill_decode_only",model_name="kvrelay-tiny"} 1.0' in await r.text()
    run(go())


def test_a_draining_or_vanished_decode_node_hands_the_request_to_another_without_pull_params():
    """The window before the health loop notices: D0 answers 503 + X-Kvrelay-Draining (or is
    gone); the client still gets its answer, from D1, which computes the prompt itself."""
    async def go(first_mode: str) -> None:
        ps, ds = await _stack(n_d=2)
        async with fake_node(ps[0]), fake_node(ds[0]), fake_node(ds[1]), \
                router_for(ps, ds, health_interval_s=60) as (url, router), aiohttp.ClientSession() as s:
            router.decode._rr = iter(range(10**6))  # type: ignore[assignment]  # start at node 0
            d0 = router.decode.nodes[0]
            if first_mode == "gone":
                d0.url = "http://127.0.0.1:9"                 # nothing listens there
            ds[0].mode = first_mode
            body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                raw = await r.read()
            assert r.status == 200 and raw == b"".join(SSE)
            assert len(ds[1].requests) == 1 and "kv_transfer_params" not in ds[1].requests[0]
            assert not d0.healthy and all(n.outstanding == 0 for n in router.decode.nodes)
            async with s.get(f"{url}/metrics") as m:
                assert 'kvrelay_router_fallbacks_total{cause="decode_redirected",model_name="kvrelay-tiny"} 1.0' in await m.text()
    run(go("draining"))
    run(go("gone"))


def test_json_logs_carry_the_request_and_transfer_id():
    """log_format: json - the router's line about a redirected request names both ids."""
    import io
    import logging

    from kvrelay.core.logs import ContextFilter, JsonFormatter

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvrelay.router")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async def go() -> None:
            ps, ds = await _stack(n_d=2, d_modes=("draining", "ok"))
            async with fake_node(ps[0]), fake_node(ds[0]), fake_node(ds[1]), \
                    router_for(ps, ds, health_interval_s=60) as (url, router), aiohttp.ClientSession() as s:
                router.decode._rr = iter(range(10**6))  # type: ignore[assignment]  # start at node 0
                async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"},
                                  headers={"X-Request-Id": "rid-json"}) as r:
                    assert r.status == 200
        run(go())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    moved = [rec for rec in lines if "goes to" in rec["msg"]]
    assert moved and moved[0]["request_id"] == "rid-json"
    assert moved[0]["transfer_id"].startswith("kvr-") and moved[0]["transfer_id"].endswith("-rid-json")
    assert {"ts", "level", "logger", "pid", "msg"} <= set(moved[0])


def test_tracing_one_router_span_under_the_clients_with_its_context_sent_to_both_engines():
    """tracing.endpoint: the router's span joins the client's trace, and P and D get its context
    as a traceparent header and beside the signed params (where the connectors' spans hang)."""
    import time

    from tests.e2e.otlp import Collector

    collector = Collector(0)
    collector.endpoint = f"http://127.0.0.1:{collector.server.server_address[1]}/v1/traces"

    async def go() -> None:
        pn, dn = Fake(), Fake()
        async with fake_node(pn), fake_node(dn):
            cfg = kcfg.from_dict({"router": {"first_token": "decode", "health_interval_s": 0.2},
                                  "tracing": {"endpoint": collector.endpoint}})
            router = Router(cfg, Pool("prefill", [Node(pn.url)], cfg.router.policy),
                            Pool("decode", [Node(dn.url, "tcp://127.0.0.1:9100")], cfg.router.policy))
            async with serve(router.app()) as url, aiohttp.ClientSession() as s:
                for _ in range(50):
                    if all(n.healthy for n in router.prefill.nodes + router.decode.nodes):
                        break
                    await asyncio.sleep(0.05)
                tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
                async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"},
                                  headers={"traceparent": tp, "X-Request-Id": "rid-t"}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.2)
        for fake in (pn, dn):
            header = fake.headers[0]["traceparent"]
            assert header.split("-")[1] == "ab" * 16 and fake.requests[0]["kv_transfer_params"]["traceparent"] == header
    try:
        run(go())
        deadline = time.monotonic() + 10
        while not collector.trace("ab" * 16) and time.monotonic() < deadline:
            time.sleep(0.2)
        (span,) = collector.trace("ab" * 16)
        assert span["name"] == "kvrelay.request" and span["parent"] == "cd" * 8
        assert span["attrs"]["kvrelay.request_id"] == "rid-t" and span["service"] == "kvrelay-router"
    finally:
        collector.close()


def test_no_response_names_a_node_unless_expose_nodes():
    """/health gives pool counts, a 502 says what failed but not where, and /metrics labels a
    node with an opaque id; ``router.expose_nodes`` shows the addresses (before the fix /health
    listed every node's URL outside the /v1 gate and a 502 named the decode node)."""
    async def go() -> None:
        for expose in (False, True):
            async with one_pair(d_mode="reset", expose_nodes=expose, breaker_failures=1) as (url, s, pn, dn):
                async with s.get(f"{url}/health") as r:
                    health = await r.json()
                async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3}) as r:
                    assert r.status == 502
                    failed = await r.text()
                async with s.get(f"{url}/metrics") as r:
                    metrics = await r.text()
                port = dn.url.rsplit(":", 1)[1]
                assert health["decode"]["healthy"] == 1 and health["prefill"]["total"] == 1
                assert "kvrelay_router_breaker_opens_total{model_name=\"kvrelay-tiny\",node=" in metrics
                for text in (json.dumps(health), failed, metrics):
                    assert (port in text) == expose, (expose, text[:300])
    run(go())


def test_a_client_that_hangs_up_mid_body_is_counted_not_logged_as_a_server_error(caplog):
    """A client that closes its connection while sending its body is a client disconnect: no
    ``Error handling request`` traceback from aiohttp, no 500, one count of its cause."""
    async def go() -> None:
        async with one_pair() as (url, s, _pn, _dn):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.transport.abort()                # a reset, as a killed client's kernel sends
            await asyncio.sleep(0.3)
            async with s.get(f"{url}/metrics") as m:
                text = await m.text()
            assert 'kvrelay_router_client_errors_total{cause="client_disconnect",model_name="kvrelay-tiny"} 1.0' in text
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        run(go())
    assert not [r for r in caplog.records if r.name == "aiohttp.server"], caplog.text


def test_a_min_tokens_request_is_prefilled_without_it_so_the_prefill_node_takes_it():
    """Token 1 from D: P computes one discarded token. vLLM answers ``min_tokens`` > ``max_tokens``
    with a 400, and D, which took the request, then waited ``connector.first_chunk_s`` (20-30 s)
    for a push that never came - 80 such stalls in one LoRA sweep. P's copy carries no min_tokens."""
    async def go() -> None:
        async with one_pair(first_token="decode") as (url, s, pn, dn):
            body = {"model": "m", "prompt": "x", "max_tokens": 20, "min_tokens": 5}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
            await asyncio.sleep(0.2)
            assert pn.requests and "min_tokens" not in pn.requests[-1] and pn.requests[-1]["max_tokens"] == 1
            assert dn.requests[-1]["min_tokens"] == 5                    # D answers the client's request as sent
    run(go())
