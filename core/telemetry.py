"""What a node tells operators: the JSONL event log and the connectors' Prometheus metrics."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time
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

    def drain(self) -> list[float]:
        out = []
        while self._recent:
            out.append(self._recent.popleft())
        return out

    def collect(self) -> Any:
        return self.histogram.collect()


class Metrics:
    """The connectors' Prometheus metrics (one set per process)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        buckets = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10)
        self.tokens_loaded = Counter("kvrelay_tokens_loaded", "Prompt tokens installed from pushed chunks")
        self.tokens_recomputed = Counter("kvrelay_tokens_recomputed",
                                         "Prompt tokens recomputed after a failed chunk (fallback)")
        self.chunks = Counter("kvrelay_chunks", "Chunks by side and outcome", ["side", "outcome"])
        self.bytes = Counter("kvrelay_bytes", "Payload bytes moved", ["side"])
        self.forced_frees = Counter("kvrelay_push_forced_frees",
                                    "Prefill requests whose blocks were freed at the deadline")
        self.load_latency = Recorded(Histogram("kvrelay_chunk_load_latency_seconds",
                                               "Chunk arrival to installed in the engine's KV cache", buckets=buckets))
        self.store_latency = Recorded(Histogram("kvrelay_chunk_store_latency_seconds",
                                                "Chunk ready on prefill to push complete", buckets=buckets))
        self.transfer_latency = Recorded(Histogram("kvrelay_transfer_latency_seconds",
                                                   "Decode: request scheduled to last chunk installed",
                                                   buckets=buckets))
        self.store_stored = Counter("kvrelay_store_chunks_stored", "Chunks put into the store")
        self.store_loaded_tokens = Counter("kvrelay_store_tokens_loaded",
                                           "Prompt tokens loaded from the store instead of computed")
        self.inflight = Gauge("kvrelay_transfers_inflight", "Transfers in flight", ["side"])
        self.pool_leased = Gauge("kvrelay_pool_slots_busy", "Receive pool slots leased, filled or held")
        self.pool_slots = Gauge("kvrelay_pool_slots", "Receive pool slots in all (the busy gauge's ceiling)")
        self.receiver_entries = Gauge("kvrelay_receiver_entries",
                                      "Per-transfer entries the decode node's receiver tracks (0 when idle)")
        self.events_dropped = Gauge("kvrelay_events_dropped", "Event-log lines lost (disk full, unwritable path)")
        self.store_forged = Gauge("kvrelay_store_records_forged", "Shared-tier records refused for a bad MAC "
                                  "(written without the deployment's secret), by tier (cumulative)", ["tier"])
        self.store_hits = Gauge("kvrelay_store_hits", "Chunks the store served, by tier (cumulative)", ["tier"])
        self.store_bytes = Gauge("kvrelay_store_bytes_loaded", "Bytes the store served, by tier (cumulative)",
                                 ["tier"])
        self.store_misses = Gauge("kvrelay_store_misses", "Chunk reads no store tier could serve (cumulative)")
        self.store_evictions = Gauge("kvrelay_store_evictions", "Chunks evicted from the CPU tier (cumulative)")
        self.refusals = Gauge("kvrelay_receiver_refusals", "Writes and messages the decode node's receiver "
                              "refused, by cause (cumulative)", ["cause"])


@functools.cache
def _the_metrics() -> Metrics:
    return Metrics()


@functools.cache
def _exporter(port: int, host: str) -> None:
    from prometheus_client import start_http_server

    start_http_server(port, addr=host)


def metrics(port: int = 0, host: str = "127.0.0.1") -> Metrics:
    """The process's one set of metrics; a ``port`` also starts an exporter on ``host:port``
    (once per address; loopback by default: expose it wider only on a network you trust)."""
    m = _the_metrics()
    if port:
        _exporter(port, host)
    return m
