"""Follow every engine's KV-cache events into the router's :class:`~kvrelay.router.kv_index.KVIndex`.

One ZeroMQ SUB socket per engine. The events carry the prompts' token ids, so they must
reach the router alone, and nobody else may publish into it. vLLM binds its
``--kv-events-config`` endpoint when it is an ``ipc://`` path or a wildcard address and
connects otherwise; the router does the opposite:

- ``ipc:///path`` (what ``kvrelay up`` uses): the engine binds a Unix socket in the node's
  private runtime directory (0700, :mod:`kvrelay.common.private_files`), the router connects.
  No other local user can enter the directory: none can read the events, publish forged ones
  (a replayed low sequence number would wipe an engine's claims), or take the endpoint first.
- ``tcp://host:port`` named in ``router.kv_events``: the router binds it and the engine
  connects (the router's host and port must then be the router's alone).

Frames over :data:`~kvrelay.router.followers.MAX_FRAME_BYTES` end the publisher's connection
unread. vLLM's frames are ``[topic, seq (8 bytes, big-endian), msgpack EventBatch]``. An
endpoint that cannot be bound or connected leaves that engine placed by load alone, with an
error in the log and ``kvrelay_router_kv_events_following{node} 0`` (``report``).

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

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
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
_MONITORS = itertools.count()        # each socket's monitor gets an address of its own (a closed one may linger)
RETRY_S, MAX_RETRY_S = 1.0, 30.0     # a new socket after a loss; the back-off while one cannot be set up


def parse_entries(entries: Iterable[str]) -> dict[str, str]:
    """``["http://h:8100=tcp://h:9500", ...]`` -> ``{"http://h:8100": "tcp://h:9500"}``."""
    out = {}
    for entry in entries:
        url, _, endpoint = entry.partition("=")
        out[url.rstrip("/")] = endpoint
    return out


class KVEvents:
    """Subscribers for the engines of some pools, feeding one index."""

    def __init__(self, index: KVIndex, named: Mapping[str, str], port: int = 0,
                 report: Callable[[str, bool], None] = lambda url, following: None) -> None:
        """``named``: engine URL -> its endpoint (``ipc://`` the router connects to, ``tcp://`` it
        binds); ``port``: every other engine publishes on its own host at this port, where the
        router connects (0: none does). ``report(url, following)``: each change of state."""
        self.index, self.named, self.port, self.report = index, dict(named), port, report
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
        """Follow ``url``'s events until cancelled: a session per connection, and a fresh socket
        after each loss (ZeroMQ itself does not reconnect after a protocol error, such as an
        oversize frame), retried with a back-off while the endpoint cannot be bound or reached."""
        backoff = RETRY_S
        while True:
            backoff = RETRY_S if await self._session(url, endpoint) else min(MAX_RETRY_S, 2 * backoff)
            await asyncio.sleep(backoff)

    async def _session(self, url: str, endpoint: str) -> bool:
        """One socket's life: until its publisher is lost (True) or it cannot be set up (False)."""
        sock = subscriber()
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
                                          addr=f"inproc://kvrelay-kv-events-monitor-{next(_MONITORS)}")
        try:
            if url in self.named and not endpoint.startswith("ipc://"):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            log.error("KV events of %s: cannot follow %s (%s); it is placed by load alone", url, endpoint, exc)
            self.report(url, False)
            monitor.close(linger=0)
            sock.close(linger=0)
            return False
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready and self._on_monitor(url, endpoint,
                                                         parse_monitor_message(await monitor.recv_multipart())):
                    return True
                if sock in ready:
                    self._on_frames(url, endpoint, await sock.recv_multipart())
        finally:
            self.connected.discard(url)
            self.report(url, False)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _on_monitor(self, url: str, endpoint: str, event: Mapping[str, Any]) -> bool:
        """Track the connection; True when the publisher was lost (its claims are forgotten)."""
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected.add(url)
            self.report(url, True)
            log.info("KV events of %s: following its publisher (%s)", url, endpoint)
        elif event["event"] in _LOST and url in self.connected:
            self.connected.discard(url)
            self.report(url, False)
            self.index.forget(url)              # whatever it stores until we are back, we would miss
            log.warning("KV events of %s: lost %s; routing it by load until they resume", url, endpoint)
            return True
        return False

    def _on_frames(self, url: str, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("KV events of %s: unexpected %d-frame message from %s", url, len(frames), endpoint)
            return
        try:
            batch = decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("KV events of %s: bad batch from %s: %s", url, endpoint, exc)
            return
        stats = self.index.stats
        gaps, restarts = stats.missed_batches, stats.restarts
        self.index.apply(url, int.from_bytes(frames[1], "big"), batch)
        if stats.missed_batches != gaps or stats.restarts != restarts:
            log.warning("KV events of %s: %s in its sequence; its claims are rebuilt from its next events", url,
                        "a gap" if stats.missed_batches != gaps else "a restart")
