"""Decode-side saves: chunks completed by generated tokens go into the shared Redis tier.

Why: a prefill node stores only the *prompt* chunks it computes. The next turn of a
conversation resends the previous answer as part of its prompt, but the chunks that
answer completed were computed on the decode node (D), so without this every turn
recomputes the previous answer plus the prompt tail before it. With
``store.enabled``, ``store.save_decoded`` and ``store.redis_url`` (the tier every
prefill node reads):

1. *Scheduler* (:class:`kvrelay.decode.connector.DecodeScheduler`): when a request finishes,
   the whole chunks of its computed tokens (prompt + output, minus the last sampled
   token, whose KV was never computed) that hold at least one generated token become
   a :class:`SaveSpec`. ``request_finished`` returns ``True`` so vLLM keeps the blocks
   until the save is done; the next ``build_connector_meta`` hands it over.
2. *Worker* (:class:`DecodeSaver`): one thread asks Redis which of those chunks it
   lacks (one pipelined query), gathers each missing chunk from the paged KV into a
   checksummed record under the key computed from the tokens (the keys the prefill
   nodes compute), writes them in pipelined batches of ``store.deferred_bytes``, and
   reports the request in ``finished_sending``: vLLM frees the blocks.
3. The next turn's prefill node finds the chunks with its batched lookup and loads
   them instead of computing them.

D keeps no CPU or disk tier of its own: nobody would read them. A Redis outage is a
logged warning (the next turn recomputes), never a failed or stuck request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvrelay.common.keys import chunk_keys
from kvrelay.common.secrets import load_secret
from kvrelay.core.chunk_records import gather_record
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.placement import place_helper_thread
from kvrelay.core.telemetry import EventLog, metrics
from kvrelay.kernels.layout import KVLayout
from kvrelay.store.records import seal_for
from kvrelay.store.tiers import RedisTier

log = logging.getLogger("vllm.kvrelay.decode")


@dataclass(frozen=True)
class SaveSpec:
    req_id: str
    token_ids: list[int]       # the computed tokens of whole chunks: n_chunks * chunk_tokens
    block_ids: list[int]       # the request's blocks, covering token_ids
    first_chunk: int           # first chunk holding a generated token
    namespace: bytes = b""     # the request's KV namespace (core/kv_namespace.py): its store keys


def save_spec(request: Any, block_ids: list[int], chunk_tokens: int, namespace: bytes = b"") -> SaveSpec | None:
    """What a finished request on D should save, or None (no whole chunk with output in it)."""
    n_prompt = len(request.prompt_token_ids)
    computed = min(request.num_computed_tokens, len(request.all_token_ids))
    n_chunks = computed // chunk_tokens
    first = n_prompt // chunk_tokens
    if n_chunks <= first or not block_ids:
        return None
    return SaveSpec(request.request_id, list(request.all_token_ids[:n_chunks * chunk_tokens]),
                    list(block_ids), first, namespace)


class DecodeSaver:
    """Worker half of decode-side saves (one thread; ``done(req_id)`` when a save ends)."""

    def __init__(self, cfg: KVRelayConfig, blocks_per_chunk: int, events: EventLog,
                 done: Callable[[str], None]) -> None:
        self.cfg, self.events, self.done = cfg, events, done
        self.redis = RedisTier(cfg.store.redis_url, seal=seal_for(load_secret(cfg.transport)),
                               password=cfg.store.redis_password(), ca_file=cfg.store.redis_ca_file)
        self.metrics = metrics(cfg.connector.metrics_port, cfg.connector.metrics_host)
        self.blocks_per_chunk = blocks_per_chunk
        self.layout: KVLayout | None = None
        self.fingerprint: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-decode-save",
                                        initializer=place_helper_thread, initargs=(cfg.connector.helper_cpus,))
        self._lock = threading.Lock()
        self._pending = 0

    def bind(self, layout: KVLayout, fingerprint: Any) -> None:
        self.layout, self.fingerprint = layout, fingerprint

    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def submit(self, specs: list[SaveSpec]) -> None:
        """Queue saves (model thread; returns at once)."""
        for spec in specs:
            with self._lock:
                self._pending += 1
            self._pool.submit(self._run, spec)

    def _run(self, spec: SaveSpec) -> None:
        t0, saved = time.monotonic(), 0
        try:
            saved = self._save(spec)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("request %s: decode-side save failed (%s); the next turn recomputes", spec.req_id, exc)
        finally:
            with self._lock:
                self._pending -= 1
            self.events.write("decode_save", req=spec.req_id, first_chunk=spec.first_chunk,
                              chunks=len(spec.token_ids) // self.cfg.chunk_tokens - spec.first_chunk,
                              written=saved, seconds=round(time.monotonic() - t0, 6))
            self.done(spec.req_id)

    def _save(self, spec: SaveSpec) -> int:
        """Write the chunks Redis lacks, in batches of ``store.deferred_bytes``; return how many."""
        assert self.layout is not None
        per = self.blocks_per_chunk
        keys = chunk_keys(spec.token_ids, self.fingerprint, self.cfg.chunk_tokens, spec.namespace)[spec.first_chunk:]
        have = self.redis.contains(keys)
        batch: list[tuple[bytes, bytes | bytearray]] = []
        size = written = 0
        for c, (key, present) in enumerate(zip(keys, have, strict=True), start=spec.first_chunk):
            if present:
                continue
            record = gather_record(self.layout, spec.block_ids[c * per:(c + 1) * per], key, c)
            batch.append((key, record))
            size += len(record)
            if size >= int(self.cfg.store.deferred_bytes):
                written += self._put(batch)
                batch, size = [], 0
        return written + self._put(batch)

    def _put(self, batch: list[tuple[bytes, bytes | bytearray]]) -> int:
        n = self.redis.put(batch) if batch else 0
        self.metrics.store_stored.inc(n)
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.redis.close()
