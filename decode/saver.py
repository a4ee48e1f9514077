"""Decode-side saves: chunks completed by generated tokens go into the shared store.

Why: a prefill node stores only the *prompt* chunks it computes. The next turn of a
conversation resends the previous answer as part of its prompt, but the chunks that
answer completed were computed on the decode node (D), so without this every turn
recomputes the previous answer plus the prompt tail before it. With
``store.enabled`` and ``store.save_decoded``:

1. *Scheduler* (:class:`decode.connector.DecodeScheduler`): when a request finishes,
   the full chunks of its computed tokens (prompt + output, minus the last sampled
   token, whose KV was never computed) that contain at least one generated token
   become a :class:`SaveSpec`. ``request_finished`` returns ``True`` so vLLM keeps the
   blocks until the save is done; the next ``build_connector_meta`` hands it over.
2. *Worker* (:class:`DecodeSaver`): one thread gathers each chunk from the paged KV,
   wraps it in a checksummed record under the key computed from the tokens (the same
   keys the prefill nodes compute), puts it into the store, flushes the store's
   deferred buffer (so the chunks reach Redis now, not at the next 8 MiB), and reports
   the request in ``finished_sending``: vLLM frees the blocks.
3. The next turn's prefill node finds those chunks in Redis with its usual batched
   lookup and loads them instead of computing them.

A save that fails is logged and dropped: it only costs the next turn a recompute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kernels.blocks import KVLayout, gather
from kvrelay import pd
from kvrelay.config import KVRelayConfig
from prefill.cache import StoreService
from transport.errors import KVRelayError
from transport.keys import chunk_keys

log = logging.getLogger("vllm.kvrelay.decode")


@dataclass(frozen=True)
class SaveSpec:
    req_id: str
    token_ids: list[int]       # the computed tokens of whole chunks: n_chunks * chunk_tokens
    block_ids: list[int]       # the request's blocks, covering token_ids
    first_chunk: int           # first chunk holding a generated token


def save_spec(request: Any, block_ids: list[int], chunk_tokens: int) -> SaveSpec | None:
    """What a finished request on D should save, or None (no whole chunk with output in it)."""
    n_prompt = len(request.prompt_token_ids)
    computed = min(request.num_computed_tokens, len(request.all_token_ids))
    n_chunks = computed // chunk_tokens
    first = n_prompt // chunk_tokens
    if n_chunks <= first or not block_ids:
        return None
    return SaveSpec(request.request_id, list(request.all_token_ids[:n_chunks * chunk_tokens]),
                    list(block_ids), first)


class DecodeSaver:
    """Worker half of decode-side saves (one thread; ``done(req_id)`` when a save ends)."""

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any, events: pd.EventLog,
                 done: Callable[[str], None]) -> None:
        self.cfg, self.events, self.done = cfg, events, done
        self.service = StoreService(cfg, vllm_config, events, serve_lookups=False, publish=False)
        self.block_size: int = vllm_config.cache_config.block_size
        self.layout: KVLayout | None = None
        self.fingerprint: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-decode-save",
                                        initializer=pd.place_helper_thread, initargs=(cfg.connector.helper_cpus,))
        self._lock = threading.Lock()
        self._pending = 0

    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def bind(self, layout: KVLayout, fingerprint: Any) -> None:
        self.layout, self.fingerprint = layout, fingerprint
        self.service.bind(layout, fingerprint)

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
        except (KVRelayError, OSError, RuntimeError) as exc:
            log.warning("request %s: decode-side save failed (%s); the next turn recomputes", spec.req_id, exc)
        finally:
            with self._lock:
                self._pending -= 1
            self.events.write("decode_save", req=spec.req_id, chunks=saved, first_chunk=spec.first_chunk,
                              tokens=len(spec.token_ids), seconds=round(time.monotonic() - t0, 6))
            self.done(spec.req_id)

    def _save(self, spec: SaveSpec) -> int:
        assert self.layout is not None
        T = self.cfg.chunk_tokens
        per = T // self.block_size
        keys = chunk_keys(spec.token_ids, self.fingerprint, T)            # [n_chunks]
        for c in range(spec.first_chunk, len(keys)):
            ids = torch.tensor(spec.block_ids[c * per:(c + 1) * per], dtype=torch.int64, device=self.layout.device)
            buf = torch.empty((self.layout.num_layers, per, self.layout.bytes_per_block), dtype=torch.uint8)
            self.service.save(keys[c], c, gather(self.layout, ids, buf.to(self.layout.device)).cpu())
        self.service.store.flush(wait=False)
        return len(keys) - spec.first_chunk

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.service.close()
