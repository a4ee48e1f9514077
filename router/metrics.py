"""The router's Prometheus series (its own registry, served on the router's ``/metrics``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.router.decide import RoutePath
from kvrelay.router.pools import Pool

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.nodes = Gauge("kvrelay_router_nodes", "Nodes per pool: in rotation (healthy) or out",
                           ["pool", "state"], registry=self.registry)
        self.requests = Counter("kvrelay_router_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.errors = Counter("kvrelay_router_errors", "Errors by cause", ["cause"], registry=self.registry)
        self.latency = Histogram("kvrelay_router_request_latency_seconds", "Request latency",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kvrelay_router_ttft_seconds", "Time to the first token the client gets",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.migrations = Counter("kvrelay_router_migrations", "Answers moved to another decode node mid-stream, "
                                  "by what the failed node did", ["cause"], registry=self.registry)
        self.migrated = Counter("kvrelay_router_migrated_requests", "Requests that lost a decode node, by how they "
                                "ended (exact: greedy, token-identical; sampled; failed)", ["outcome"],
                                registry=self.registry)
        self.kv_events_following = Gauge("kvrelay_router_kv_events_following", "1 while the router follows the "
                                         "engine's KV events (decode_first); 0: it is placed by load alone (its "
                                         "publisher is gone, or its endpoint could not be bound or connected)",
                                         ["node"], registry=self.registry)
        self.breaker_opens = Counter("kvrelay_router_breaker_opens", "Times a node's circuit breaker opened "
                                     "(consecutive request failures)", ["node"], registry=self.registry)
        self.decisions = Counter("kvrelay_router_decisions", "Requests by the path the router chose: "
                                 "disaggregated, decode_only (decode_first: little left to compute), "
                                 "decode_required, no_prefill", ["path"], registry=self.registry)
        self.cached_tokens = Counter("kvrelay_router_cached_prompt_tokens", "Prompt tokens the chosen engine's "
                                     "prefix cache held when the request was placed (decode_first: by its KV "
                                     "events), by the engine's role", ["role"], registry=self.registry)
        self.prompt_tokens = Counter("kvrelay_router_placed_prompt_tokens", "Prompt tokens of requests placed with "
                                     "a known prompt (decode_first), the denominator of the cached share",
                                     registry=self.registry)
        for path in RoutePath:                  # every series exists from the start, at 0 (Prometheus convention)
            self.decisions.labels(path.value)
        for role in ("decode", "prefill"):
            self.cached_tokens.labels(role)
        self.itl = Histogram("kvrelay_router_itl_seconds", "Time between streamed pieces the client gets",
                             buckets=ITL_BUCKETS, registry=self.registry)

    def decided(self, path: str, prompt_tokens: int, decode_held: int, prefill_held: int = 0) -> None:
        """One placement: its path, and (prompt known) the prompt tokens the chosen engines held."""
        self.decisions.labels(path).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_tokens.labels("decode").inc(decode_held)
            if prefill_held:
                self.cached_tokens.labels("prefill").inc(prefill_held)

    def follow(self, pools: tuple[Pool, ...]) -> None:
        """Node gauges read the pools at scrape time (membership may change: router/discovery.py)."""
        def count(pool: Pool, healthy: bool) -> float:
            return float(sum(n.healthy is healthy for n in pool.nodes))
        for pool in pools:
            self.nodes.labels(pool.name, "healthy").set_function(functools.partial(count, pool, True))
            self.nodes.labels(pool.name, "out").set_function(functools.partial(count, pool, False))
        self.registry.register(_PendingTokens(pools[0]))     # the prefill pool


class _PendingTokens(Collector):
    """``kvrelay_router_prefill_pending_tokens{node}``, read from the pool at scrape time (its
    members change under DNS discovery)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("kvrelay_router_prefill_pending_tokens",
                              "cache_aware: prompt tokens sent to a prefill node and not yet answered",
                              labels=["node"])
        for n in list(self.pool.nodes):
            g.add_metric([n.url], float(n.pending_tokens))
        yield g
