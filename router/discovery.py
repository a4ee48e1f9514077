"""Pool membership from DNS: ``dns+http://name:port`` entries, re-resolved periodically.

A Kubernetes headless Service (``clusterIP: None``) resolves to the addresses of its
ready pods, so a pool entry such as ``dns+http://kvrelay-decode.ns.svc:8000`` stands for
every decode pod. Decode entries carry the transfer endpoint on the same name:
``dns+http://kvrelay-decode.ns.svc:8000=tcp://kvrelay-decode.ns.svc:9100``; every
resolved address gets ``http://ADDR:8000`` and ``tcp://ADDR:9100``.

Contract:

* :meth:`Discovery.refresh` resolves every entry once and reconciles the pool: a new
  address becomes a node *out of rotation* (the health loop admits it once ``/health``
  answers), a node whose address no longer resolves leaves the pool (its in-flight
  requests finish; nothing new is sent), and nodes that stay keep their state
  (outstanding counts, health). Static entries are never touched.
* A failed lookup changes nothing: a DNS outage must not empty a pool.
* The resolver is injected (``async (host, port) -> [address, ...]``); the default asks
  the system resolver through the event loop, so it never blocks routing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvrelay.router.pools import DNS_PREFIX, Node, Pool

log = logging.getLogger("kvrelay.router")

Resolver = Callable[[str, int], Awaitable[list[str]]]


def url_host(addr: str) -> str:
    """``addr`` as a URL's host: an IPv6 address in brackets."""
    return f"[{addr}]" if ":" in addr else addr


@dataclass(frozen=True)
class DnsEntry:
    """One ``dns+http://name:port[=tcp://name:kvport]`` pool entry."""

    scheme: str          # http | https
    host: str
    port: int
    side_scheme: str = ""   # "tcp" for a decode node's transfer endpoint / a prefill node's events
    side_port: int = 0

    def node(self, addr: str, decode: bool) -> Node:
        host = url_host(addr)
        side = f"{self.side_scheme}://{host}:{self.side_port}" if self.side_port else ""
        url = f"{self.scheme}://{host}:{self.port}"
        return Node(url, kv_endpoint=side) if decode else Node(url, events_endpoint=side)


def parse_dns(entry: str, decode: bool) -> DnsEntry:
    """``dns+http://name:8000=tcp://name:9100`` -> DnsEntry. ValueError names the entry."""
    main, sep, side = entry[len(DNS_PREFIX):].partition("=")
    u = urlsplit(main)
    if u.scheme not in ("http", "https") or not u.hostname or not u.port:
        raise ValueError(f"pool entry {entry!r}: expected 'dns+http://name:port'")
    if decode and not sep:
        raise ValueError(f"decode entry {entry!r}: add the transfer port, 'dns+http://name:port=tcp://name:kvport'")
    if not sep:
        return DnsEntry(u.scheme, u.hostname, u.port)
    s = urlsplit(side)
    if s.scheme != "tcp" or not s.port or s.hostname != u.hostname:
        raise ValueError(f"pool entry {entry!r}: the part after '=' must be tcp://{u.hostname}:PORT (same name)")
    return DnsEntry(u.scheme, u.hostname, u.port, "tcp", s.port)


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Keeps one pool's DNS-backed nodes in step with what the names resolve to."""

    def __init__(self, pool: Pool, entries: Iterable[DnsEntry], *, decode: bool,
                 resolver: Resolver = system_resolver, on_change: Callable[[], None] | None = None) -> None:
        self.pool, self.entries, self.decode = pool, list(entries), decode
        self.resolver, self.on_change = resolver, on_change
        self._managed: set[str] = set()       # urls this discovery added

    async def refresh(self) -> None:
        wanted: dict[str, Node] = {}
        for e in self.entries:
            try:
                addrs = await self.resolver(e.host, e.port)
            except OSError as exc:
                log.warning("%s pool: cannot resolve %s (%s); keeping its current nodes", self.pool.name, e.host, exc)
                return
            for a in addrs:
                node = e.node(a, self.decode)
                wanted[node.url] = node
        current = {n.url for n in self.pool.nodes}
        gone = self._managed - wanted.keys()
        added = [n for url, n in wanted.items() if url not in current]
        if not gone and not added:
            return
        self.pool.nodes[:] = [n for n in self.pool.nodes if n.url not in gone] + added
        self._managed = (self._managed - gone) | {n.url for n in added}
        for url in sorted(gone):
            log.info("%s pool: %s no longer resolves; out of the pool", self.pool.name, url)
        for n in added:
            log.info("%s pool: found %s (in rotation once healthy)", self.pool.name, n.url)
        if self.on_change is not None:
            self.on_change()

    async def run(self, interval_s: float) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)
