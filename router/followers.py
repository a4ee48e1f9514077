"""One asyncio task per followed node, kept in step with the pools' membership.

Both event sources the router follows (the prefill nodes' store events,
:mod:`kvrelay.router.cache_index`, and every engine's KV events, :mod:`kvrelay.router.kv_events`)
run one subscriber task per node URL. :class:`Followers` owns those tasks: :meth:`Followers.sync`
starts one for each new node (or a node whose endpoint moved) and cancels the others, telling
the owner to ``forget`` what that node held; :meth:`Followers.stop` cancels them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import zmq
import zmq.asyncio

from kvrelay.common.tasks import cancel_all

MAX_FRAME_BYTES = 16 << 20    # a larger message ends the peer's connection (ZMQ_MAXMSGSIZE) before it is read


def subscriber() -> zmq.asyncio.Socket:
    """A SUB socket that takes every message up to :data:`MAX_FRAME_BYTES`, keeps at most 1,000
    unread, and drops what is unsent on close."""
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


class Followers:
    def __init__(self, follow: Callable[[str, str], Coroutine[Any, Any, None]],
                 forget: Callable[[str], None]) -> None:
        """``follow(url, endpoint)``: the subscriber coroutine; ``forget(url)``: drop what it taught us."""
        self._follow, self._forget = follow, forget
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}     # url -> (endpoint, task)

    def sync(self, wanted: Mapping[str, str]) -> None:
        """Follow exactly ``wanted`` (url -> endpoint). Needs a running event loop; non-blocking."""
        for url in [u for u, (ep, _) in self._tasks.items() if wanted.get(u) != ep]:
            self._tasks.pop(url)[1].cancel()
            self._forget(url)
        for url, ep in wanted.items():
            if url not in self._tasks:
                self._tasks[url] = (ep, asyncio.create_task(self._follow(url, ep)))

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        await cancel_all(tasks)
