"""Follow every engine's KV-cache events into the router's :class:`~kvrelay.router.kv_index.KVIndex`.

One ZeroMQ SUB socket per engine, which the router **binds** and the engine's publisher
connects to: vLLM connects whenever its ``--kv-events-config`` endpoint names a host (it
binds only wildcard addresses). The events carry the prompts' token ids, so they travel
to the router alone instead of to anyone who can reach an engine's port. vLLM's frames
are ``[topic, seq (8 bytes, big-endian), msgpack EventBatch]``.

The socket's monitor tells when the publisher's connection drops or comes back: on a drop
the engine's entries are forgotten at once (what it stores meanwhile would be missed), so
a dead or restarted publisher costs the router its hints, never a claim that is not true;
that engine is placed by load alone until its events resume.

``router.kv_events`` names each engine's endpoint by its URL (``kvrelay up`` fills them
in); :meth:`KVEvents.sync` follows the pools' current members that have one. Where pool
members come and go (Kubernetes), ``router.kv_events_port`` turns it around for every member
not named: its engine binds that port and the router **connects** to ``tcp://<its host>:<port>``
(ZeroMQ reconnects by itself; the NetworkPolicy keeps the port to the routers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvrelay.router.discovery import url_host
from kvrelay.router.followers import Followers, subscriber
from kvrelay.router.kv_index import KVIndex, decode_batch
from kvrelay.router.pools import Node

log = logging.getLogger("kvrelay.router")

_LOST = {zmq.EVENT_DISCONNECTED, zmq.EVENT_MONITOR_STOPPED}


def parse_entries(entries: Iterable[str]) -> dict[str, str]:
    """``["http://h:8100=tcp://h:9500", ...]`` -> ``{"http://h:8100": "tcp://h:9500"}``."""
    out = {}
    for entry in entries:
        url, _, endpoint = entry.partition("=")
        out[url.rstrip("/")] = endpoint
    return out


class KVEvents:
    """Subscribers for the engines of some pools, feeding one index."""

    def __init__(self, index: KVIndex, named: Mapping[str, str], port: int = 0) -> None:
        """``named``: engine URL -> the endpoint the router binds for it; ``port``: every other
        engine publishes on its own host at this port, where the router connects (0: none does)."""
        self.index, self.named, self.port = index, dict(named), port
        self._followers = Followers(self._follow, index.forget)
        self.connected: set[str] = set()

    def endpoint(self, url: str) -> str | None:
        if url in self.named:
            return self.named[url]
        host = urlsplit(url).hostname
        return f"tcp://{url_host(host)}:{self.port}" if self.port and host else None

    def sync(self, nodes: Iterable[Node]) -> None:
        """Follow exactly ``nodes`` that publish (needs a running loop; non-blocking)."""
        wanted = {n.url: self.endpoint(n.url) for n in nodes}
        self._followers.sync({url: ep for url, ep in wanted.items() if ep})

    async def stop(self) -> None:
        await self._followers.stop()

    async def _follow(self, url: str, endpoint: str) -> None:
        sock = subscriber()
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            if url in self.named:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            log.error("KV events of %s: cannot follow %s (%s); it is placed by load alone", url, endpoint, exc)
            monitor.close(linger=0)
            sock.close(linger=0)
            return
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    self._on_monitor(url, endpoint, parse_monitor_message(await monitor.recv_multipart()))
                if sock in ready:
                    self._on_frames(url, endpoint, await sock.recv_multipart())
        finally:
            self.connected.discard(url)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _on_monitor(self, url: str, endpoint: str, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected.add(url)
            log.info("KV events of %s: following its publisher (%s)", url, endpoint)
        elif event["event"] in _LOST and url in self.connected:
            self.connected.discard(url)
            self.index.forget(url)              # whatever it stores until we are back, we would miss
            log.warning("KV events of %s: lost %s; routing it by load until they resume", url, endpoint)

    def _on_frames(self, url: str, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("KV events of %s: unexpected %d-frame message from %s", url, len(frames), endpoint)
            return
        try:
            batch = decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("KV events of %s: bad batch from %s: %s", url, endpoint, exc)
            return
        self.index.apply(url, int.from_bytes(frames[1], "big"), batch)
