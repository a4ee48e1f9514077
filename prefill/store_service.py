"""The prefill worker's store service: the multi-tier store, the lookup server, chunk loads and saves.

* the scheduler's :class:`kvrelay.prefill.lookup.StoreClient` asks :meth:`StoreService._serve`
  (a local ZeroMQ REP socket) how many leading prompt tokens are stored;
* the hit is loaded **synchronously** in ``start_load_kv`` of the step that computes
  the rest of the prompt (:meth:`StoreService.load_into`), with ``prefetch_ahead``
  lower-tier reads in flight; a chunk that cannot be loaded is reported through
  ``get_block_ids_with_load_errors`` and recomputed by vLLM;
* every full chunk the engine computes is gathered by the push thread and put into the
  store (batch-and-defer: only the CPU tier is on the request's path).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from kvrelay.common.errors import KVRelayError
from kvrelay.common.keys import chunk_keys
from kvrelay.common.secrets import KeyUse, derive_key, load_secret
from kvrelay.common.wire import parse_header
from kvrelay.core.chunk_records import gather_record, record_payload
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.placement import place_helper_thread
from kvrelay.core.rank_view import tp_rank, tp_size
from kvrelay.core.telemetry import EventLog, metrics
from kvrelay.kernels.blocks import scatter
from kvrelay.kernels.layout import KVLayout
from kvrelay.prefill.lookup import SLOW_LOOKUP_S, Lookup, LookupReply, hit_limit, lookup_endpoint
from kvrelay.prefill.payloads import SavedChunk
from kvrelay.store.publisher import Publisher
from kvrelay.store.records import read_record, seal_for
from kvrelay.store.store import MultiTierStore

log = logging.getLogger("vllm.kvrelay.prefill")


class StoreService:
    """Worker side: the store, the lookup server, and chunk load/save."""

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any, events: EventLog) -> None:
        """With tensor parallelism every rank keeps its own records (keys under its own
        fingerprint, which names its rank and TP size: records are per layout); rank 0 answers
        the scheduler's lookups and publishes the events the router routes by, and the disk
        tier gets a directory per rank. A chunk rank 0 holds that another rank lost is
        recomputed there (reported as a failed load), never taken from another layout."""
        self.cfg, self.events = cfg, events
        self.metrics = metrics(cfg.connector.metrics_port, cfg.connector.metrics_host)
        s = cfg.store
        secret = load_secret(cfg.transport)
        rank, tp = tp_rank(vllm_config), tp_size(vllm_config)
        self.publisher = (Publisher(s.publish_host or cfg.transport.host, s.publish_port,
                                    derive_key(secret, KeyUse.EVENTS)) if s.publish_port and rank == 0 else None)
        disk = str(Path(s.disk_path) / f"rank{rank}") if s.disk_path and tp > 1 else s.disk_path
        self.store = MultiTierStore(int(s.cpu_bytes), policy=s.eviction_policy.value, disk_path=disk,
                                    disk_bytes=int(s.disk_bytes), redis_url=s.redis_url,
                                    deferred_bytes=int(s.deferred_bytes), prefetch_ahead=s.prefetch_ahead,
                                    on_event=self.publisher, seal=seal_for(secret),
                                    redis_password=s.redis_password(), redis_ca_file=s.redis_ca_file)
        self._export_stats()
        self.endpoint = lookup_endpoint(vllm_config)
        self.layout: KVLayout | None = None
        self.fingerprint: Any = None
        self.block_size: int = vllm_config.cache_config.block_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvrelay-store-lookup", daemon=True)
        if rank == 0:                                  # one lookup server per engine
            self._thread.start()

    def _export_stats(self) -> None:
        """The store's counts as counters, read at scrape time (and at each engine step)."""
        m, stats = self.metrics, self.store.stats
        for tier in self.store.lower:
            m.store_forged.bind(functools.partial(getattr, tier, "forged"), tier.name)
            m.store_errors.bind(functools.partial(getattr, tier, "errors", 0), tier.name)
        for name in ["cpu", *(t.name for t in self.store.lower)]:
            m.store_hits.bind(functools.partial(lambda n: stats.hits.get(n, 0), name), name)
            m.store_bytes.bind(functools.partial(lambda n: stats.bytes_loaded.get(n, 0), name), name)
        m.store_misses.bind(lambda: stats.misses)
        m.store_evictions.bind(lambda: stats.evicted)

    def bind(self, layout: KVLayout, fingerprint: Any) -> None:
        self.layout, self.fingerprint = layout, fingerprint
        if self.publisher is not None:
            self.publisher.bind_engine(fingerprint.digest(), self.cfg.chunk_tokens)

    def keys(self, token_ids: list[int], namespace: bytes = b"") -> list[bytes]:
        return chunk_keys(token_ids, self.fingerprint, self.cfg.chunk_tokens, namespace)

    def _serve(self) -> None:
        place_helper_thread(self.cfg.connector.helper_cpus)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        path = self.endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
        sock.bind(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                try:
                    req = msgspec.msgpack.decode(sock.recv(), type=Lookup)
                    t0 = time.monotonic()
                    hit = self._lookup(req.token_ids, req.namespace)
                    if (took := time.monotonic() - t0) > SLOW_LOOKUP_S:
                        log.warning("store lookup of %d tokens took %.3f s", len(req.token_ids), took)
                except msgspec.DecodeError as exc:
                    log.warning("bad store lookup: %s", exc)
                    hit = 0
                sock.send(msgspec.msgpack.encode(LookupReply(hit)))
        finally:
            sock.close(linger=0)

    def _lookup(self, token_ids: list[int], namespace: bytes = b"") -> int:
        if self.fingerprint is None:
            return 0
        T = self.cfg.chunk_tokens
        n_full = hit_limit(len(token_ids), T) // T
        if n_full == 0:
            return 0
        return self.store.lookup_prefix(self.keys(token_ids[: n_full * T], namespace)) * T

    # ---------------------------------------------------------------- load (model thread)
    def load_into(self, req_id: str, token_ids: list[int], block_ids: list[int], start: int, end: int,
                  namespace: bytes = b"") -> set[int]:
        """Install store chunks covering tokens [start, end) into ``block_ids``; return failed blocks."""
        assert self.layout is not None
        T, bs = self.cfg.chunk_tokens, self.block_size
        first, last = start // T, end // T
        keys = self.keys(token_ids[: last * T], namespace)[first:]
        t0, loaded = time.monotonic(), 0
        for i, (_key, view) in enumerate(self.store.load(keys)):
            if view is None:
                break
            c = first + i
            try:
                _hdr, payload = read_record(view)
            except KVRelayError as exc:
                log.warning("store chunk %d of %s unusable: %s", c, req_id, exc)
                break
            src = torch.frombuffer(payload, dtype=torch.uint8)
            src = src.view(self.layout.num_layers, T // bs, self.layout.bytes_per_block)
            skip = max(0, start // bs - c * (T // bs))
            ids = torch.tensor(block_ids[c * (T // bs) + skip:(c + 1) * (T // bs)], dtype=torch.int64)
            scatter(self.layout, ids.to(self.layout.device), src[:, skip:].to(self.layout.device))
            loaded += 1
        done_tokens = (first + loaded) * T
        failed = set(block_ids[done_tokens // bs:end // bs]) if done_tokens < end else set()
        self.metrics.store_loaded_tokens.inc(done_tokens - start)
        self.events.write("store_load", req=req_id, hit_tokens=end - start, loaded_tokens=done_tokens - start,
                          seconds=round(time.monotonic() - t0, 6), tiers=dict(self.store.stats.hits),
                          tier_bytes=dict(self.store.stats.bytes_loaded))
        return failed

    # ---------------------------------------------------------------- save (push thread)
    def save(self, key: bytes, c: int, block_ids: list[int]) -> SavedChunk:
        """Gather full chunk ``c`` (engine blocks ``block_ids``) straight into a new record and put
        it into the store; return its payload, ``[L, blocks, bpb]`` uint8 - a view of the record
        the store keeps, which the push may send but must not change - with its checksum."""
        assert self.layout is not None
        record = gather_record(self.layout, block_ids, key, c)
        if self.store.put(key, record):
            self.metrics.store_stored.inc()
        return SavedChunk(record_payload(self.layout, record, len(block_ids)), parse_header(record).payload_sum)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:             # started (rank 0)
            self._thread.join(timeout=2)
        self.store.close()
        if self.publisher is not None:
            self.publisher.close()
