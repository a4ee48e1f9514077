"""PrefillConnector: vLLM v1 KV connector, producer role. Pushes chunks as they are computed.

Same role as ``decode/connector.py``: one role's vLLM KV connector.

Request lifecycle on a prefill node (P)
---------------------------------------
1. The router sends P the request with ``max_tokens=1`` and
   ``kv_transfer_params={"kvrelay": {"role": "push", "transfer_id": T, "push_to": "tcp://D:port"}}``.
2. *Scheduler process* (:class:`PrefillScheduler`): ``get_num_new_matched_tokens``
   records the params; every ``build_connector_meta`` tells the worker, per push
   request, its block ids so far and how many prompt tokens will have KV after this
   step (``ready``) - chunked prefill spreads a long prompt over several steps.
3. *Worker process* (:class:`PushWorker`): ``wait_for_save`` (end of each forward)
   hands every chunk that became complete to the push thread. The push thread
   connects to D once (Hello), asks for slots for all the prompt's chunks
   (``Alloc``), and writes each chunk as soon as it is ready - so chunk 0 is on
   the wire while later steps still compute. NIXL posts the engine blocks directly
   (one region per layer x block, no copy); tcp gathers each chunk once.
4. Preemption: vLLM frees a preempted request's blocks at once. Before the next forward
   can overwrite them, ``handle_preemptions`` ends the request's push (D recomputes) and
   waits for the writes still reading them; nothing more is gathered or stored from that
   request. A resumed request's block list is replaced, not extended.
5. ``request_finished`` (scheduler) returns ``True``: the blocks stay allocated until
   the worker reports the request in ``finished_sending`` - when every chunk is
   written, the push failed, or ``connector.free_deadline_s`` passed (then the
   transfer is aborted and the forced free counted). ``has_pending_push_work`` keeps
   the engine stepping meanwhile.

Failures never fail the prefill request: a refused Alloc, a dead decode node or a
write error aborts the transfer; D sees the failure and recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.core.config import KVRelayConfig
from kvrelay.core.connector_base import RelayConnector
from kvrelay.core.guard import count_refusal, verifier_for
from kvrelay.core.kv_namespace import kv_namespace, opaque_prompt
from kvrelay.core.params import ParamsError, ParamsVerifier, PushParams
from kvrelay.core.tracing import traceparent_of
from kvrelay.prefill.lookup import StoreClient, hit_limit, lookup_endpoint
from kvrelay.prefill.messages import PrefillMeta
from kvrelay.prefill.pusher import PushWorker
from kvrelay.prefill.specs import PushSpec, StoreLoad

log = logging.getLogger("vllm.kvrelay.prefill")


class PrefillScheduler:
    """Scheduler-process half: tracks push (and, with the store on, all) requests and their blocks."""

    def __init__(self, cfg: KVRelayConfig, store: StoreClient | None = None,
                 verifier: ParamsVerifier | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.verifier = verifier or verifier_for(cfg, producer=True)
        self._params: dict[str, PushParams | None] = {}   # tracked while their prefill runs
        self._prompt_len: dict[str, int] = {}
        self._store_from: dict[str, int] = {}
        self._trace: dict[str, str] = {}            # request -> traceparent (tracing on)
        self._ns: dict[str, bytes] = {}             # request -> its KV namespace (LoRA adapter)
        self._blocks: dict[str, list[int]] = {}
        self._hits: dict[str, tuple[int, int]] = {}
        self._loads: list[StoreLoad] = []
        self._delayed: set[str] = set()
        self._finished: list[str] = []

    def on_request(self, request: Any) -> None:
        rid = request.request_id
        if rid in self._params:
            return
        if opaque_prompt(request):               # keys would not name its images or embeddings: no push, no store
            return
        try:
            params = self.verifier.check(request.kv_transfer_params)
        except ParamsError as exc:        # the API-server guard answers these with a 400 first
            count_refusal(exc)
            log.warning("request %s: %s; serving it without a push", rid, exc)
            params = None
        if isinstance(params, PushParams) or self.store is not None:
            self._params[rid] = params if isinstance(params, PushParams) else None
            self._prompt_len[rid] = len(request.prompt_token_ids)
            self._trace[rid] = traceparent_of(request.kv_transfer_params)
            self._ns[rid] = kv_namespace(request)

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        self.on_request(request)
        rid = request.request_id
        if self.store is None or rid not in self._params:
            return 0, False
        hit = min(self.store.lookup(list(request.prompt_token_ids), self._ns.get(rid, b"")),
                  hit_limit(len(request.prompt_token_ids), self.cfg.chunk_tokens))
        # Store every full chunk the store lacks - also those the engine's own prefix cache
        # supplied (wholly, or in part: its 128-token blocks need not end on a chunk boundary).
        # Saving only what this step computes left such chunks out of the store for good, and
        # every later lookup of that conversation stopped at the first one.
        self._store_from[rid] = hit
        if hit <= num_computed:
            return 0, False
        self._hits[rid] = (num_computed, hit)
        return hit - num_computed, False

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        hit = self._hits.pop(request.request_id, None)
        if hit is not None and num_external > 0:
            start, end = hit
            self._loads.append(StoreLoad(request.request_id, list(request.prompt_token_ids),
                                         list(blocks.get_block_ids()[0]), start, start + num_external,
                                         self._ns.get(request.request_id, b"")))

    def build_meta(self, so: Any) -> PrefillMeta:
        """This step's work for the worker. Preemption (vLLM 0.32): a request in
        ``preempted_req_ids`` lost its blocks - its push is ended before another byte is
        gathered (the worker's ``handle_preemptions`` runs before this step's forward); when
        it resumes (``resumed_req_ids``), ``new_block_ids`` *replaces* its block list."""
        meta = PrefillMeta(loads=self._loads, finished=self._finished, idle=so.total_num_scheduled_tokens == 0)
        self._loads, self._finished = [], []
        for rid in getattr(so, "preempted_req_ids", None) or ():
            if rid in self._blocks:
                meta.preempted.append(rid)
                self._blocks[rid] = []                # freed: nothing may be read from them any more
        for r in so.scheduled_new_reqs:
            if r.req_id in self._params:
                self._blocks[r.req_id] = list(r.block_ids[0])
                ready = r.num_computed_tokens + so.num_scheduled_tokens[r.req_id]
                meta.pushes.append(self._spec(r.req_id, ready, list(r.prompt_token_ids)))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._params or rid not in self._blocks:
                continue
            new = cached.new_block_ids[i]
            if rid in resumed:
                self._blocks[rid] = list(new[0]) if new is not None else []
            elif new is not None:
                self._blocks[rid].extend(new[0])
            meta.pushes.append(self._spec(rid, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid]))
        return meta

    def _spec(self, rid: str, ready: int, token_ids: list[int] | None = None) -> PushSpec:
        p, n = self._params[rid], self._prompt_len[rid]
        store_from = self._store_from.get(rid, 0) if self.store is not None else -1
        spec = PushSpec(rid, p.transfer_id if p else "", p.push_to if p else "", n, list(self._blocks[rid]),
                        min(ready, n), token_ids, store_from, bool(p and p.early),
                        self._trace.get(rid, "") if token_ids is not None else "",
                        self._ns.get(rid, b"") if token_ids is not None else b"")
        if ready >= n:                            # prefill done: nothing more to tell the worker
            del self._params[rid]
        return spec

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for d in (self._params, self._prompt_len, self._store_from, self._hits, self._trace, self._ns):
            d.pop(rid, None)
        if self._blocks.pop(rid, None) is None:
            return False, None                    # never scheduled (or not tracked)
        self._delayed.add(rid)
        self._finished.append(rid)
        return True, None

    def update_output(self, out: Any) -> None:
        for rid in out.finished_sending or ():
            self._delayed.discard(rid)

    def has_pending(self) -> bool:
        return bool(self._delayed or self._finished)

    def close(self) -> None:
        self.verifier.close()
        if self.store is not None:
            self.store.close()


class PrefillConnector(RelayConnector[PushWorker]):
    """Producer connector. Load with ``--kv-transfer-config '{"kv_connector": "PrefillConnector",
    "kv_connector_module_path": "kvrelay.prefill.connector", "kv_role": "kv_producer",
    "kv_connector_extra_config": {"kvrelay": {...}}}'``."""

    def make_scheduler(self, vllm_config: Any) -> PrefillScheduler:
        client = (StoreClient(lookup_endpoint(vllm_config), self.cfg.store.lookup_timeout_s)
                  if self.cfg.store.active else None)
        return PrefillScheduler(self.cfg, client)

    def make_worker(self, vllm_config: Any) -> PushWorker:
        return PushWorker(self.cfg, vllm_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and isinstance(meta, PrefillMeta) and meta.loads:
            self._worker.load_from_store(meta.loads)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward that may overwrite a preempted request's freed blocks: its push is
        ended, and no write still reading those blocks is left in flight (see ``PushWorker.preempt``)."""
        if self._worker is not None and isinstance(kv_connector_metadata, PrefillMeta) \
                and kv_connector_metadata.preempted:
            self._worker.preempt(kv_connector_metadata.preempted)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and isinstance(meta, PrefillMeta):
            self._worker.on_step(meta.pushes, meta.finished)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._settled(), None
