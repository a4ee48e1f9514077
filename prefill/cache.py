"""The prefill node's multi-tier store: lookups from the scheduler, loads and saves in the worker.

vLLM runs the connector's scheduler half and worker half in different processes. The
store (CPU tier = worker memory, plus disk / Redis) lives in the worker, so the worker
also answers the scheduler's lookups over a local ZeroMQ socket:

* scheduler ``get_num_new_matched_tokens`` -> :class:`StoreClient.lookup` (prompt tokens)
  -> worker computes the chunk keys and one batched query per tier -> hit tokens;
* the hit is loaded **synchronously** in ``start_load_kv`` of the step that computes
  the rest of the prompt (:meth:`StoreService.load_into`), with ``prefetch_ahead``
  lower-tier reads in flight; a chunk that cannot be loaded is reported through
  ``get_block_ids_with_load_errors`` and recomputed by vLLM;
* every full chunk the engine computes is gathered by the push thread and put into the
  store (batch-and-defer: only the CPU tier is on the request's path).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from typing import Any

import msgspec
import torch
import zmq

from kernels.blocks import KVLayout, scatter
from kvrelay import pd
from kvrelay.config import KVRelayConfig
from transport.errors import KVRelayError
from transport.keys import chunk_keys
from transport.store.store import MultiTierStore
from transport.wire import HEADER_SIZE, make_header, parse_header

log = logging.getLogger("vllm.kvrelay.prefill")


class Lookup(msgspec.Struct, frozen=True):
    token_ids: list[int]
    v: int = 1


class LookupReply(msgspec.Struct, frozen=True):
    hit_tokens: int
    v: int = 1


class StoreEvent(msgspec.Struct, frozen=True):
    """Published by a prefill node: chunks that entered (``stored``) or left (``evicted``) its store.

    ``fingerprint`` is the node's engine fingerprint digest - the router needs it to
    compute the same chunk keys from a request's tokens."""

    kind: str
    keys: list[bytes]
    fingerprint: bytes
    chunk_tokens: int
    v: int = 1


class Publisher:
    """ZeroMQ PUB of StoreEvents (thread-safe; the store calls it from several threads)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        self._sock.bind(f"tcp://{host}:{port}")
        self._lock = threading.Lock()
        self.fingerprint = b""
        self.chunk_tokens = 0

    def __call__(self, kind: str, keys: list[bytes]) -> None:
        if not self.fingerprint:
            return
        msg = msgspec.msgpack.encode(StoreEvent(kind, keys, self.fingerprint, self.chunk_tokens))
        with self._lock, contextlib.suppress(zmq.Again):   # a slow subscriber: events are only hints
            self._sock.send(msg, zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)


SLOW_LOOKUP_S = 0.1   # the worker logs lookups slower than this (the scheduler waits on them)


def lookup_endpoint(vllm_config: Any) -> str:
    engine = vllm_config.kv_transfer_config.engine_id or "default"
    return f"ipc://{tempfile.gettempdir()}/kvrelay-store-{engine}.sock"


def store_enabled(cfg: KVRelayConfig) -> bool:
    return int(cfg.store.cpu_bytes) > 0 and cfg.store.enabled


def hit_limit(n_prompt: int, chunk_tokens: int) -> int:
    """Loadable prefix: whole chunks, always leaving >= 1 prompt token to compute."""
    return ((n_prompt - 1) // chunk_tokens) * chunk_tokens


class StoreClient:
    """Scheduler side. A lookup that times out counts as a miss (the prompt is computed)."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        self.endpoint, self.timeout_ms = endpoint, int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None

    def lookup(self, token_ids: list[int]) -> int:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        self._sock.send(msgspec.msgpack.encode(Lookup(list(token_ids))))
        if not self._sock.poll(self.timeout_ms):
            log.warning("store lookup got no answer in %.1f s (%s); computing the prompt",
                        self.timeout_ms / 1000, self.endpoint)
            self._sock.close(linger=0)
            self._sock = None
            return 0
        return msgspec.msgpack.decode(self._sock.recv(), type=LookupReply).hit_tokens


def chunk_record(key: bytes, c: int, gathered: torch.Tensor) -> bytes:
    """A stored chunk: the wire header (key, xxh3 checksum) + ``[L, blocks, bpb]`` bytes."""
    payload = gathered.numpy().data
    return make_header(key, "store", c, [payload], num_layers=gathered.shape[0],
                       num_blocks=gathered.shape[1]).pack() + bytes(payload)


class StoreService:
    """Worker side: the store, the lookup server, and chunk load/save."""

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any, events: pd.EventLog) -> None:
        self.cfg, self.events = cfg, events
        self.metrics = pd.metrics(cfg.connector.metrics_port)
        s = cfg.store
        self.publisher = Publisher(cfg.transport.host, s.publish_port) if s.publish_port else None
        self.store = MultiTierStore(int(s.cpu_bytes), policy=s.eviction_policy.value, disk_path=s.disk_path,
                                    disk_bytes=int(s.disk_bytes), redis_url=s.redis_url,
                                    deferred_bytes=int(s.deferred_bytes), prefetch_ahead=s.prefetch_ahead,
                                    on_event=self.publisher)
        self.endpoint = lookup_endpoint(vllm_config)
        self.layout: KVLayout | None = None
        self.fingerprint: Any = None
        self.block_size: int = vllm_config.cache_config.block_size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvrelay-store-lookup", daemon=True)
        self._thread.start()

    def bind(self, layout: KVLayout, fingerprint: Any) -> None:
        self.layout, self.fingerprint = layout, fingerprint
        if self.publisher is not None:
            self.publisher.chunk_tokens = self.cfg.chunk_tokens
            self.publisher.fingerprint = fingerprint.digest()

    def keys(self, token_ids: list[int]) -> list[bytes]:
        return chunk_keys(token_ids, self.fingerprint, self.cfg.chunk_tokens)

    def _serve(self) -> None:
        pd.place_helper_thread(self.cfg.connector.helper_cpus)
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
                    hit = self._lookup(req.token_ids)
                    if (took := time.monotonic() - t0) > SLOW_LOOKUP_S:
                        log.warning("store lookup of %d tokens took %.3f s", len(req.token_ids), took)
                except msgspec.DecodeError as exc:
                    log.warning("bad store lookup: %s", exc)
                    hit = 0
                sock.send(msgspec.msgpack.encode(LookupReply(hit)))
        finally:
            sock.close(linger=0)

    def _lookup(self, token_ids: list[int]) -> int:
        if self.fingerprint is None:
            return 0
        T = self.cfg.chunk_tokens
        n_full = hit_limit(len(token_ids), T) // T
        if n_full == 0:
            return 0
        return self.store.lookup_prefix(self.keys(token_ids[: n_full * T])) * T

    # ---------------------------------------------------------------- load (model thread)
    def load_into(self, req_id: str, token_ids: list[int], block_ids: list[int], start: int, end: int) -> set[int]:
        """Install store chunks covering tokens [start, end) into ``block_ids``; return failed blocks."""
        assert self.layout is not None
        T, bs = self.cfg.chunk_tokens, self.block_size
        first, last = start // T, end // T
        keys = self.keys(token_ids[: last * T])[first:]
        t0, loaded = time.monotonic(), 0
        for i, (_key, view) in enumerate(self.store.load(keys)):
            if view is None:
                break
            c = first + i
            try:
                hdr = parse_header(view)
            except KVRelayError as exc:
                log.warning("store chunk %d of %s unusable: %s", c, req_id, exc)
                break
            src = torch.frombuffer(view[HEADER_SIZE:HEADER_SIZE + hdr.payload_len], dtype=torch.uint8)
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
    def save(self, key: bytes, c: int, gathered: torch.Tensor) -> None:
        """Put one full chunk (``[L, blocks, bpb]`` uint8 on CPU) into the store."""
        if self.store.put(key, chunk_record(key, c, gathered)):
            self.metrics.store_stored.inc()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.store.close()
        if self.publisher is not None:
            self.publisher.close()
