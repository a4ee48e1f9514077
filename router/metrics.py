"""The router's Prometheus series (its own registry, served on the router's ``/metrics``).

Named as vLLM names its own where they measure the same thing (``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds``, under the router's prefix), and
every series carries vLLM's ``model_name`` label. What went wrong is counted in three families,
so an alert on one means one thing:

* ``kvrelay_router_request_failures_total{cause}``: the stack failed the request (a node failed,
  none was healthy, the router shed it);
* ``kvrelay_router_fallbacks_total{cause}``: the request was served another way (decode alone,
  another decode node, token 1 from D): no failure;
* ``kvrelay_router_client_errors_total{cause}``: the client's doing (a bad or oversize body,
  no key, a rate limit, a hang-up, a reader too slow).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.router.decide import RoutePath
from kvrelay.router.pools import Pool

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FALLBACKS = frozenset({"decode_only", "decode_redirected", "decode_retried", "first_token_fallback",
                       "no_prefill_decode_only", "prefill_failed_decode_only"})
CLIENT_ERRORS = frozenset({"bad_request", "body_timeout", "body_too_large", "client_disconnect", "client_too_slow",
                           "client_inflight_limit", "rate_limited", "unauthorized"})
MODEL = "model_name"


class Bound:
    """A labelled metric with its ``model_name`` given once: ``.labels(*rest)``."""

    def __init__(self, metric: Any, model: str) -> None:
        self.metric, self.model = metric, model

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.model, *values)


class Causes:
    """``.labels(cause)``: the child of the family ``cause`` belongs to (failure, fallback, client)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        def family(name: str, doc: str) -> Counter:
            return Counter(name, doc, [MODEL, "cause"], registry=registry)
        self.failures = family("kvrelay_router_request_failures", "Requests the stack failed, by cause")
        self.fallbacks = family("kvrelay_router_fallbacks", "Requests served another way than planned, by cause "
                                "(no failure)")
        self.client = family("kvrelay_router_client_errors", "Requests refused or cut short by the client's doing, "
                             "by cause")
        self.model = model

    def labels(self, cause: str) -> Any:
        family = self.fallbacks if cause in FALLBACKS else self.client if cause in CLIENT_ERRORS else self.failures
        return family.labels(self.model, cause)


class RouterMetrics:
    def __init__(self, model: str = "", inflight: Callable[[], float] | None = None,
                 queued: Callable[[], float] | None = None) -> None:
        """``model``: the served model name (vLLM's ``model_name`` label); ``inflight`` /
        ``queued``: read at scrape time (admission's running and waiting requests)."""
        self.registry = r = CollectorRegistry()
        self.model = model
        self.nodes = Bound(Gauge("kvrelay_router_nodes", "Nodes per pool: in rotation (healthy) or out",
                                 [MODEL, "pool", "state"], registry=r), model)
        self.requests = Bound(Counter("kvrelay_router_requests", "Requests by endpoint and outcome",
                                      [MODEL, "endpoint", "outcome"], registry=r), model)
        self.errors = Causes(r, model)
        self.latency = Histogram("kvrelay_router_e2e_request_latency_seconds", "Request latency, as the client sees it",
                                 [MODEL], buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.ttft = Histogram("kvrelay_router_time_to_first_token_seconds", "Time to the first token the client gets",
                              [MODEL], buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("kvrelay_router_inter_token_latency_seconds", "Time between streamed pieces the client "
                             "gets", [MODEL], buckets=ITL_BUCKETS, registry=r).labels(model)
        self.migrations = Bound(Counter("kvrelay_router_migrations", "Answers moved to another decode node "
                                        "mid-stream, by what the failed node did", [MODEL, "cause"], registry=r), model)
        self.migrated = Bound(Counter("kvrelay_router_migrated_requests", "Requests that lost a decode node, by how "
                                      "they ended (exact: greedy, token-identical; sampled; failed)",
                                      [MODEL, "outcome"], registry=r), model)
        self.kv_events_following = Bound(Gauge(
            "kvrelay_router_kv_events_following", "1 while the router follows the engine's KV events (decode_first); "
            "0: it is placed by load alone (its publisher is gone, or its endpoint could not be bound or "
            "connected)", [MODEL, "node"], registry=r), model)
        self.breaker_opens = Bound(Counter("kvrelay_router_breaker_opens", "Times a node's circuit breaker opened "
                                           "(consecutive request failures)", [MODEL, "node"], registry=r), model)
        self.decisions = Bound(Counter("kvrelay_router_decisions", "Requests by the path the router chose: "
                                       "disaggregated, decode_only (decode_first: little left to compute), "
                                       "decode_required, no_prefill", [MODEL, "path"], registry=r), model)
        self.cached_tokens = Bound(Counter("kvrelay_router_cached_prompt_tokens", "Prompt tokens the chosen engine's "
                                           "prefix cache held when the request was placed (decode_first: by its KV "
                                           "events), by the engine's role", [MODEL, "role"], registry=r), model)
        self.prompt_tokens = Counter("kvrelay_router_placed_prompt_tokens", "Prompt tokens of requests placed with "
                                     "a known prompt (decode_first), the denominator of the cached share",
                                     [MODEL], registry=r).labels(model)
        for gauge, doc, read in (("kvrelay_router_requests_running", "Requests the router is serving", inflight),
                                 ("kvrelay_router_requests_waiting", "Requests waiting for admission", queued)):
            if read is not None:
                Gauge(gauge, doc, [MODEL], registry=r).labels(model).set_function(read)
        for path in RoutePath:                  # every series exists from the start, at 0 (Prometheus convention)
            self.decisions.labels(path.value)
        for role in ("decode", "prefill"):
            self.cached_tokens.labels(role)

    def decided(self, path: str, prompt_tokens: int, decode_held: int, prefill_held: int = 0) -> None:
        """One placement: its path, and (prompt known) the prompt tokens the chosen engines held."""
        self.decisions.labels(path).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_tokens.labels("decode").inc(decode_held)
            if prefill_held:
                self.cached_tokens.labels("prefill").inc(prefill_held)

    def follow(self, pools: tuple[Pool, ...], label: Callable[[str], str] = str) -> None:
        """Node gauges read the pools at scrape time (membership may change: router/discovery.py)."""
        def count(pool: Pool, healthy: bool) -> float:
            return float(sum(n.healthy is healthy for n in pool.nodes))
        for pool in pools:
            self.nodes.labels(pool.name, "healthy").set_function(functools.partial(count, pool, True))
            self.nodes.labels(pool.name, "out").set_function(functools.partial(count, pool, False))
        self.registry.register(_PendingTokens(pools[0], self.model, label))     # the prefill pool


class _PendingTokens(Collector):
    """``kvrelay_router_prefill_pending_tokens{node}``, read from the pool at scrape time (its
    members change under DNS discovery)."""

    def __init__(self, pool: Pool, model: str, label: Callable[[str], str]) -> None:
        self.pool, self.model, self.label = pool, model, label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("kvrelay_router_prefill_pending_tokens",
                              "cache_aware: prompt tokens sent to a prefill node and not yet answered",
                              labels=[MODEL, "node"])
        for n in list(self.pool.nodes):
            g.add_metric([self.model, self.label(n.url)], float(n.pending_tokens))
        yield g
