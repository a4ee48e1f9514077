"""Runtime LoRA adapter loads go to every node through the router (router/lora_admin.py), against
real HTTP servers that answer as vLLM does with and without runtime updates allowed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kvrelay.router.lora_admin import fan_out
from kvrelay.router.pools import Node


async def _node(status: int, seen: list[bytes]) -> tuple[web.AppRunner, str]:
    async def load(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(status=status, text="Success" if status == 200 else "Not Found")
    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_an_adapter_is_loaded_on_every_node_or_the_failures_are_named():
    async def main() -> None:
        seen: list[bytes] = []
        ok1, u1 = await _node(200, seen)
        ok2, u2 = await _node(200, seen)
        bad, u3 = await _node(404, seen)
        body = json.dumps({"lora_name": "sql", "lora_path": "/adapters/sql"}).encode()
        try:
            async with aiohttp.ClientSession() as s:
                good = await fan_out(s, [Node(u1), Node(u2)], "/v1/load_lora_adapter", body)
                assert good.status == 200 and seen == [body, body]
                mixed = await fan_out(s, [Node(u1), Node(u3), Node("http://127.0.0.1:9")], "/v1/load_lora_adapter",
                                      body, timeout_s=5)
                err = json.loads(mixed.body)["error"]        # type: ignore[arg-type]
                assert mixed.status == 502 and "2 of 3 nodes" in err["message"]
                assert f"{u3}: 404 Not Found" in err["message"] and "127.0.0.1:9: no answer" in err["message"]
                assert (await fan_out(s, [], "/v1/load_lora_adapter", body)).status == 503
        finally:
            for r in (ok1, ok2, bad):
                await r.cleanup()
    asyncio.run(main())
