"""LoRA adapters loaded at run time, through the router: vLLM's own endpoints on every node.

A request for an adapter may be served by any prefill and any decode node (the split path
runs it on both), so an adapter must be loaded everywhere or nowhere useful. The router
forwards ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's bodies:
``{"lora_name": ..., "lora_path": ...}``) to every node of both pools at once and answers 200
only when every node did; otherwise an OpenAI-style error naming each node that did not, and
what it said. vLLM serves these endpoints only when its engines run with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.

The adapter's files must be at ``lora_path`` on every node. Each node keys the adapter's KV by
its name and a digest of those files (:mod:`kvrelay.core.kv_namespace`), so nodes that were given
different files under one name never exchange its KV: they recompute instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from kvrelay.router.pools import Node
from kvrelay.router.responses import error_response

ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float) -> tuple[int, str]:
    """``(status, text)`` of one node's answer; status 0 when it gave none."""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, (await r.text())[:300]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


async def fan_out(session: aiohttp.ClientSession, nodes: Iterable[Node], path: str, body: bytes,
                  timeout_s: float = 60.0) -> web.Response:
    """POST ``body`` to ``path`` on every node; 200 when all answered 200, else 502 naming the rest."""
    urls = sorted({n.url for n in nodes})
    if not urls:
        return error_response(503, "no node to load the adapter on", "service_unavailable")
    answers = await asyncio.gather(*(_post(session, f"{u}{path}", body, timeout_s) for u in urls))
    failed = [f"{u}: {status or 'no answer'} {text.strip()}" for u, (status, text) in zip(urls, answers, strict=True)
              if status != 200]
    if not failed:
        return web.json_response({"nodes": urls, "status": "ok"})
    return error_response(502, f"{path} failed on {len(failed)} of {len(urls)} nodes (vLLM serves it only with "
                          f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): " + "; ".join(failed), code="adapter_update_failed")


def lora_handler(nodes: Callable[[], list[Node]],
                 session: Callable[[], aiohttp.ClientSession | None]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The router's handler for :data:`ADAPTER_PATHS`: the request's body to every node of ``nodes()``."""
    async def handle(request: web.Request) -> web.Response:
        s = session()
        if s is None:
            return error_response(503, "the router is starting", "service_unavailable")
        return await fan_out(s, nodes(), request.path, await request.read())
    return handle
