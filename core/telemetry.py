"""What a node tells operators: the JSONL event log and the connectors' Prometheus metrics."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("vllm.kvrelay")
EVENTS_MAX_BYTES = 64 << 20     # the log is rotated to ``<path>.1`` past this size


class EventLog:
    """Append-only JSONL of connector events (thread-safe; no-op when path is empty).

    Never raises: the log is a diagnostic, so a full disk or a vanished directory must
    not kill the push or install thread that writes it (and that writes it again from
    its error handler). Lost lines are counted in ``dropped`` and logged once per 1,000.
    Past ``max_bytes`` the file is rotated to ``<path>.1`` (one generation kept); every
    process appends through a fresh open, so all writers follow the rotation."""

    def __init__(self, path: str, node: str, *, max_bytes: int = EVENTS_MAX_BYTES) -> None:
        self._path = path
        self._node = node
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self.dropped = 0

    def write(self, event: str, **fields: Any) -> None:
        if not self._path:
            return
        line = json.dumps({"t": time.time(), "node": self._node, "event": event, **fields}, default=str)
        with self._lock:
            try:
                with open(self._path, "a") as f:
                    f.write(line + "\n")
                    size = f.tell()
                if size > self._max_bytes:
                    os.replace(self._path, self._path + ".1")
            except OSError as exc:
                self.dropped += 1
                if self.dropped % 1000 == 1:
                    log.warning("event log %s: %s (%d lines dropped so far)", self._path, exc, self.dropped)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event in a log written by :class:`EventLog` (none if it does not exist). A line
    torn by a full disk is skipped, so readers never fail on it."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict):
            events.append(ev)
    return events


class Recorded:
    """A histogram that also keeps its recent observations, so they can be replayed on the
    engine's ``/metrics`` (:mod:`kvrelay.core.engine_stats`); at most ``keep`` between two drains."""

    def __init__(self, histogram: Any, keep: int = 4096) -> None:
        self.histogram = histogram
        self._recent: collections.deque[float] = collections.deque(maxlen=keep)

    def observe(self, value: float) -> None:
        self.histogram.observe(value)
        self._recent.append(value)

    def labels(self, *values: str, **kw: str) -> Any:
        return self.histogram.labels(*values, **kw)

    def drain(self) -> list[float]:
        out = []
        while self._recent:
            out.append(self._recent.popleft())
        return out

    def collect(self) -> Any:
        return self.histogram.collect()


class Sourced:
    """A counter whose value is a cumulative number kept elsewhere (the store's hit counts, the
    receiver's refusals): :meth:`bind` names where to read it, and each collection (a scrape,
    an engine step's delta) adds what it grew by. Exposed as ``<name>_total``, type counter."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), registry: Any = None) -> None:
        from prometheus_client import Counter

        self.counter = Counter(name, doc, labelnames, registry=None)
        self._sources: dict[tuple[str, ...], Callable[[], float]] = {}
        self._seen: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def bind(self, source: Callable[[], float], *labelvalues: str) -> None:
        with self._lock:
            self._sources[labelvalues] = source

    def unbind(self) -> None:
        """Stop reading the bound sources (their owner closed); the counts stay."""
        with self._lock:
            self._sources.clear()

    def labels(self, *values: str, **kw: str) -> Any:
        return self.counter.labels(*values, **kw)

    def inc(self, amount: float = 1.0) -> None:
        self.counter.inc(amount)

    def collect(self) -> Any:
        with self._lock:
            for values, source in self._sources.items():
                grown = source() - self._seen.get(values, 0.0)
                if grown > 0:
                    (self.counter.labels(*values) if values else self.counter).inc(grown)
                    self._seen[values] = self._seen.get(values, 0.0) + grown
        return self.counter.collect()


def unbind_gauge(gauge: Any) -> None:
    """Undo ``gauge.set_function``: it stores its sampler on the instance, so dropping that
    restores the gauge's own value (a closed worker's pool must not be read by the next)."""
    gauge.__dict__.pop("_child_samples", None)


# Gauges a worker holds (a state, not a count) - name: (help, own labels). The engine's API server
# reads them from the workers at scrape time (core/engine_stats.py), so they are current while the
# engine idles.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvrelay_transfers_inflight": ("Transfers in flight", ("side",)),
    "kvrelay_pool_slots_busy": ("Receive pool slots leased, filled or held", ()),
    "kvrelay_pool_slots": ("Receive pool slots in all (the busy gauge's ceiling)", ()),
    "kvrelay_receiver_entries": ("Per-transfer entries the decode node's receiver tracks (0 when idle)", ()),
}


class Metrics:
    """The connectors' Prometheus metrics (one set per process).

    ``labels`` are prepended to every family's own: the engine's API server passes vLLM's
    (``model_name``, ``engine``); a worker's exporter has none. ``gauges`` False leaves the
    :data:`GAUGES` out (the API server serves those from the workers' snapshots)."""

    def __init__(self, labels: Sequence[str] = (), gauges: bool = True) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        pre = list(labels)
        buckets = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10)

        def hist(name: str, doc: str) -> Recorded:
            return Recorded(Histogram(name, doc, pre, buckets=buckets))

        def sourced(name: str, doc: str, own: Sequence[str] = ()) -> Sourced:
            return Sourced(name, doc, [*pre, *own], REGISTRY)

        self.tokens_loaded = Counter("kvrelay_tokens_loaded", "Prompt tokens installed from pushed chunks", pre)
        self.tokens_recomputed = Counter("kvrelay_tokens_recomputed",
                                         "Prompt tokens recomputed after a failed chunk (fallback)", pre)
        self.chunks = Counter("kvrelay_chunks", "Chunks by side and outcome", [*pre, "side", "outcome"])
        self.bytes = Counter("kvrelay_bytes", "Payload bytes moved", [*pre, "side"])
        self.forced_frees = Counter("kvrelay_push_forced_frees",
                                    "Prefill requests whose blocks were freed at the deadline", pre)
        self.load_latency = hist("kvrelay_chunk_load_latency_seconds", "Chunk arrival to installed in the engine's KV cache")
        self.store_latency = hist("kvrelay_chunk_store_latency_seconds", "Chunk ready on prefill to push complete")
        self.transfer_latency = hist("kvrelay_transfer_latency_seconds", "Decode: request scheduled to last chunk installed")
        self.store_stored = Counter("kvrelay_store_chunks_stored", "Chunks put into the store", pre)
        self.store_loaded_tokens = Counter("kvrelay_store_tokens_loaded",
                                           "Prompt tokens loaded from the store instead of computed", pre)
        # name -> Gauge: what the workers' snapshots carry (core/gauge_snapshots.py); {} on the API server
        self.gauges: dict[str, Any] = {name: Gauge(name, doc, list(own)) for name, (doc, own) in GAUGES.items()} \
            if gauges else {}
        if gauges:
            g = self.gauges
            self.inflight = g["kvrelay_transfers_inflight"]
            self.pool_leased = g["kvrelay_pool_slots_busy"]
            self.pool_slots = g["kvrelay_pool_slots"]
            self.receiver_entries = g["kvrelay_receiver_entries"]
        self.events_dropped = sourced("kvrelay_events_dropped", "Event-log lines lost (disk full, unwritable path)")
        self.store_forged = sourced("kvrelay_store_records_forged", "Shared-tier records refused for a bad MAC "
                                    "(written without the deployment's secret), by tier", ["tier"])
        self.store_hits = sourced("kvrelay_store_hits", "Chunks the store served, by tier", ["tier"])
        self.store_bytes = sourced("kvrelay_store_bytes_loaded", "Bytes the store served, by tier", ["tier"])
        self.store_errors = sourced("kvrelay_store_tier_errors", "Store tier operations that failed (Redis "
                                    "unreachable), by tier: each one a miss, and the tier skipped a while", ["tier"])
        self.store_misses = sourced("kvrelay_store_misses", "Chunk reads no store tier could serve")
        self.store_evictions = sourced("kvrelay_store_evictions", "Chunks evicted from the CPU tier")
        self.refusals = sourced("kvrelay_receiver_refusals", "Writes and messages the decode node's receiver "
                                "refused, by cause", ["cause"])


@functools.cache
def _the_metrics() -> Metrics:
    return Metrics()


def has_metrics() -> bool:
    """Whether this process already built its worker metrics (an engine run in-process)."""
    return _the_metrics.cache_info().currsize > 0


@functools.cache
def labelled_metrics(labels: tuple[str, ...]) -> Metrics:
    """The engine API server's set: vLLM's ``labels`` on every family, the gauges left to the workers."""
    return Metrics(labels, gauges=False)


@functools.cache
def _exporter(port: int, host: str) -> None:
    from prometheus_client import disable_created_metrics, start_http_server

    disable_created_metrics()  # type: ignore[no-untyped-call]  # as vLLM does: no ``*_created`` gauge beside every counter
    start_http_server(port, addr=host)


def metrics(port: int = 0, host: str = "127.0.0.1") -> Metrics:
    """The process's one set of metrics; a ``port`` also starts an exporter on ``host:port``
    (once per address; loopback by default: expose it wider only on a network you trust)."""
    m = _the_metrics()
    if port:
        _exporter(port, host)
    return m
