"""Prefill/decode pools: nodes, health checks and the pick policies."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from kvrelay.common.errors import KVRelayError
from kvrelay.core.config import RouterConfig, RoutingPolicy
from kvrelay.router.breaker import Breaker, BreakerState

log = logging.getLogger("kvrelay.router")


@dataclass
class Node:
    url: str                      # http://host:port of the vLLM server
    kv_endpoint: str = ""         # decode nodes: tcp://host:port of the transfer receiver
    events_endpoint: str = ""     # prefill nodes: tcp://host:port of their store events (cache_aware)
    healthy: bool = False
    outstanding: int = 0
    pending_tokens: int = 0       # prefill nodes (cache_aware): prompt tokens sent and not yet answered
    failures: int = 0
    timeouts: int = 0             # consecutive /health timeouts


class NoHealthyNode(KVRelayError):
    """Every node of a pool is out of rotation (failed health checks or an open breaker)."""


@dataclass(frozen=True)
class PrefixHint:
    """What cache-aware routing knows of one prompt: its length and, per node url, how many
    of its leading tokens that node holds (whole chunks; a node not named holds none)."""

    prompt_tokens: int
    cached_tokens: Mapping[str, int]

    def work(self, node: Node) -> int:
        """Prompt tokens ``node`` would have to compute."""
        return self.prompt_tokens - self.cached_tokens.get(node.url, 0)


class PrefillWork:
    """Prompt tokens a prefill node was given and has not answered yet, counted on the node
    from construction until :meth:`done` (idempotent), so picks made meanwhile see the queue."""

    def __init__(self, node: Node, tokens: int) -> None:
        self.node, self.tokens = node, tokens
        node.pending_tokens += tokens

    def done(self, *_: object) -> None:
        self.node.pending_tokens -= self.tokens
        self.tokens = 0


class Pool:
    def __init__(self, name: str, nodes: list[Node], policy: RoutingPolicy, *, discovered: bool = False,
                 breaker: Breaker | None = None) -> None:
        """``discovered``: DNS fills the pool (router/discovery.py), so it may start empty.
        ``breaker``: per-node circuit breaker (:mod:`kvrelay.router.breaker`); None = never opens."""
        if not nodes and not discovered:
            raise ValueError(f"the {name} pool is empty")
        self.name = name
        self.nodes = nodes
        self.policy = policy
        self.breaker = breaker or Breaker(threshold=0)
        self._rr = itertools.count()

    def pick(self, exclude: tuple[Node, ...] = (), hint: PrefixHint | None = None,
             load_weight: float = 1.0, request_tokens: int = 0) -> Node:
        """The node for the next request (out of ``exclude``).

        ``cache_aware`` with a ``hint``: the node with the least prefill work ahead of this
        prompt's first token, in tokens - ``work = prompt - cached here`` plus ``load_weight``
        times the load there: prompt tokens sent and not yet answered, plus ``request_tokens``
        per outstanding request (decode nodes: each answer it streams). A node holding a
        shared system prompt wins while idle and stops attracting new conversations once its
        queue outweighs what its cache saves (a per-request count cannot tell a queued 4k-token
        prompt from a 40-token one). Without a hint, ``cache_aware`` and ``least_outstanding``
        pick the fewest outstanding requests. Nodes that tie take turns, so an idle pool spreads
        new prefixes over every node instead of piling them on the first one."""
        healthy = [n for n in self.nodes if n.healthy and n not in exclude]
        states = [self.breaker.state(n.url) for n in healthy]
        for n, state in zip(healthy, states, strict=True):    # a node whose backoff is over gets its probe
            if state is BreakerState.HALF_OPEN and self.breaker.allows(n.url):
                return n
        live = [n for n, state in zip(healthy, states, strict=True) if state is BreakerState.CLOSED]
        if not live:
            if healthy:
                raise NoHealthyNode(f"every healthy {self.name} node is out for failing requests (circuit breaker)")
            raise NoHealthyNode(f"no healthy {self.name} node")
        if self.policy is RoutingPolicy.CACHE_AWARE and hint is not None:
            costs = [(hint.work(n) + load_weight * (n.pending_tokens + request_tokens * n.outstanding), n.outstanding)
                     for n in live]
            best = min(costs)
            return self._turn([n for n, c in zip(live, costs, strict=True) if c == best])
        if self.policy in (RoutingPolicy.LEAST_OUTSTANDING, RoutingPolicy.CACHE_AWARE):
            low = min(n.outstanding for n in live)
            return self._turn([n for n in live if n.outstanding == low])
        return self._turn(live)

    def _turn(self, tied: list[Node]) -> Node:
        """Nodes that tie take turns; a clear winner does not use up a turn (else a pattern of
        one tie, one clear pick would give every tie to the same node)."""
        if len(tied) == 1:
            return tied[0]
        return tied[next(self._rr) % len(tied)]


def parse_decode(entry: str) -> Node:
    """``"http://host:8101=tcp://host:9100"`` -> Node(url, kv_endpoint)."""
    url, sep, kv = entry.partition("=")
    if not sep or not url.startswith("http") or not kv.startswith("tcp://"):
        raise ValueError(f"decode node {entry!r}: expected 'http://host:port=tcp://host:kvport'")
    return Node(url.rstrip("/"), kv)


def parse_prefill(entry: str) -> Node:
    """``"http://host:8100"`` or ``"http://host:8100=tcp://host:9300"`` (with store events)."""
    url, sep, events = entry.partition("=")
    if not url.startswith("http") or (sep and not events.startswith("tcp://")):
        raise ValueError(f"prefill node {entry!r}: expected 'http://host:port[=tcp://host:eventport]'")
    return Node(url.rstrip("/"), events_endpoint=events)


DNS_PREFIX = "dns+"      # a pool entry DNS expands into nodes (router/discovery.py)


def is_dns(entry: str) -> bool:
    return entry.startswith(DNS_PREFIX)


def pools_from_config(cfg: RouterConfig) -> tuple[Pool, Pool]:
    """The static entries of ``router.prefill`` / ``router.decode``; ``dns+`` entries are
    left to :class:`kvrelay.router.discovery.Discovery` (the pool may then start empty)."""
    pre = [e for e in cfg.prefill if not is_dns(e)]
    dec = [e for e in cfg.decode if not is_dns(e)]
    prefill = Pool("prefill", [parse_prefill(u) for u in pre], cfg.policy, discovered=len(pre) < len(cfg.prefill))
    decode_policy = RoutingPolicy.LEAST_OUTSTANDING if cfg.policy is RoutingPolicy.CACHE_AWARE else cfg.policy
    decode = Pool("decode", [parse_decode(e) for e in dec], decode_policy, discovered=len(dec) < len(cfg.decode))
    return prefill, decode


async def check_once(session: aiohttp.ClientSession, node: Node, max_timeouts: int = 1,
                     timeout_s: float = 2.0) -> bool:
    """One /health probe. A refused connection or an error status takes the node out at once
    (it is dead or says it is not ready); a timeout only after ``max_timeouts`` in a row, so a
    node too busy to answer within ``timeout_s`` (a long prefill on a loaded host) stays in rotation."""
    try:
        async with session.get(f"{node.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            ok = r.status == 200
        node.timeouts = 0
    except asyncio.TimeoutError:
        node.timeouts += 1
        ok = node.healthy and node.timeouts < max_timeouts
    except aiohttp.ClientError:
        node.timeouts = 0
        ok = False
    if ok != node.healthy:
        log.info("%s is now %s", node.url, "healthy" if ok else "UNHEALTHY")
    node.healthy = ok
    return ok


async def health_loop(session: aiohttp.ClientSession, pools: tuple[Pool, ...], interval: float,
                      max_timeouts: int = 1) -> None:
    while True:
        nodes = [n for p in pools for n in p.nodes]
        await asyncio.gather(*(check_once(session, n, max_timeouts) for n in nodes))
        await asyncio.sleep(interval)
