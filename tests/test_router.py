"""Router behaviour against scripted upstream servers (real HTTP on loopback, fake engines).

The fakes only script what a vLLM server answers; everything the router does - pool
picks, concurrent P/D requests, param injection, SSE passthrough, retries, errors,
client-disconnect propagation - runs for real. The end-to-end tests in tests/e2e
cover the same router in front of real vLLM.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from core import config as kcfg
from router.app import Router
from router.pools import Node, Pool

SSE = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
       b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"]


@dataclass
class Fake:
    mode: str = "ok"                       # ok | http500 | hang
    requests: list[dict] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        if self.mode == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for piece in SSE if self.mode != "hang" else SSE[:1] * 1000:
                    await resp.write(piece)
                    await asyncio.sleep(0.05 if self.mode == "hang" else 0)
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "ab"}], "usage": {"prompt_tokens": 3}})


@asynccontextmanager
async def serve(app: web.Application):
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fake_node(fake: Fake):
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_post("/v1/completions", fake.complete)
    app.router.add_post("/v1/chat/completions", fake.complete)
    async with serve(app) as url:
        fake.url = url
        yield fake


@asynccontextmanager
async def router_for(prefills: list[Fake], decodes: list[Fake], policy: str = "round_robin"):
    cfg = kcfg.from_dict({"router": {"policy": policy, "health_interval_s": 0.2}})
    pool_p = Pool("prefill", [Node(f.url) for f in prefills], cfg.router.policy)
    pool_d = Pool("decode", [Node(f.url, f"tcp://127.0.0.1:{9100 + i}") for i, f in enumerate(decodes)],
                  cfg.router.policy)
    router = Router(cfg, pool_p, pool_d)
    async with serve(router.app()) as url:
        for _ in range(50):                    # wait for the first health round
            if all(n.healthy for n in pool_p.nodes + pool_d.nodes):
                break
            await asyncio.sleep(0.05)
        yield url, router


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _stack(n_p: int = 1, n_d: int = 1, p_modes: tuple[str, ...] = (), d_modes: tuple[str, ...] = ()):
    ps = [Fake(p_modes[i] if i < len(p_modes) else "ok") for i in range(n_p)]
    ds = [Fake(d_modes[i] if i < len(d_modes) else "ok") for i in range(n_d)]
    return ps, ds


def test_pd_pair_gets_params_and_sse_passes_through_unchanged():
    async def go() -> None:
        ps, ds = await _stack()
        async with fake_node(ps[0]), fake_node(ds[0]), router_for(ps, ds) as (url, _), \
                aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "rid-1"}) as r:
                raw = await r.read()
                assert r.status == 200 and r.headers["X-Request-Id"] == "rid-1"
            assert raw == b"".join(SSE)
            await asyncio.sleep(0.1)
            p, d = ps[0].requests[0], ds[0].requests[0]
            assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
            push, pull = p["kv_transfer_params"]["kvrelay"], d["kv_transfer_params"]["kvrelay"]
            assert push["role"] == "push" and pull["role"] == "pull"
            assert push["transfer_id"] == pull["transfer_id"] and push["push_to"] == "tcp://127.0.0.1:9100"
            assert d["max_tokens"] == 5 and d["stream"] is True
            assert ds[0].headers[0]["X-Request-Id"] == "rid-1"
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


def test_decode_failure_is_a_clean_502_and_bad_json_a_400():
    async def go() -> None:
        ps, ds = await _stack(d_modes=("http500",))
        async with fake_node(ps[0]), fake_node(ds[0]), router_for(ps, ds) as (url, _), \
                aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}) as r:
                body = await r.json()
                assert r.status == 502 and body["error"]["type"] == "bad_gateway"
            async with s.post(f"{url}/v1/completions", data=b"{oops") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
            assert 'kvrelay_router_errors_total{cause="decode_failed"} 1.0' in text
            assert 'kvrelay_router_errors_total{cause="bad_request"} 1.0' in text
    run(go())


def test_client_disconnect_aborts_the_decode_stream():
    async def go() -> None:
        ps, ds = await _stack(d_modes=("hang",))
        async with fake_node(ps[0]), fake_node(ds[0]), router_for(ps, ds) as (url, _), \
                aiohttp.ClientSession() as s:
            r = await s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            await r.content.readline()
            r.close()                                   # the client goes away mid-stream
            await asyncio.wait_for(ds[0].disconnected.wait(), 5)
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
