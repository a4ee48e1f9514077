"""DecodeConnector: vLLM v1 KV connector, consumer role. Installs pushed chunks as they land.

Same role as ``prefill/connector.py``: one role's vLLM KV connector.

Request lifecycle on a decode node (D)
--------------------------------------
1. The router sends D the original request with
   ``kv_transfer_params={"kvrelay": {"role": "pull", "transfer_id": T}}`` - at the
   same time as it sends P the prefill request, so D never waits for P's reply.
2. *Scheduler process* (:class:`DecodeScheduler`): ``get_num_new_matched_tokens``
   reports every prompt token beyond D's own prefix-cache hit as loaded
   asynchronously; vLLM allocates blocks and parks the request in
   ``WAITING_FOR_REMOTE_KVS``. ``update_state_after_alloc`` records the block ids
   and the next ``build_connector_meta`` hands the load to the worker.
3. *Worker process* (:class:`kvrelay.decode.installer.InstallWorker`): owns the
   :class:`kvrelay.transport.receiver.Receiver` (the pinned receive pool and the control
   socket P connects to). ``start_load_kv`` starts one install task per new load:
   it waits for chunk events of transfer ``T`` and, **as each chunk lands**, checks
   its key against the keys D computed from its own prompt tokens, scatters its
   blocks into the engine's paged KV cache (verifying the bytes it wrote where the
   transport did not hash them on arrival) and frees the slot. Chunk 1 is installed
   while chunk 2.. are still in flight.
4. When every chunk is installed (or has failed) ``get_finished`` reports the
   request in ``finished_recving``; vLLM then schedules it, recomputing only the
   last prompt token to sample the first output token.

   *Landed transfers* (``connector.sync_landed``, on by default): every step the workers
   report the transfers wholly received (:class:`~kvrelay.decode.messages.LandedMeta`). A
   request whose transfer is among them and that computes a tail of its own (token 1 came
   from P) is loaded synchronously instead: it is scheduled at once, and its chunks are
   installed on the model thread before that step's forward. This saves the step a
   background load waits for ``finished_recving`` - the gap between token 1 (from P) and
   token 2 (from D). A chunk that fails there is reported the same way (step 5).
5. A chunk that fails (checksum, wrong key, lease expiry, dead P, timeout) is never
   used: its blocks - and everything after them - are reported through
   ``get_block_ids_with_load_errors`` and, under ``load_failure_policy: recompute``
   (default), vLLM recomputes from the first bad block; under ``fail`` the request
   errors. Per request the worker logs and counts loaded vs recomputed tokens.
6. A request aborted while loading keeps its blocks (``request_finished`` returns
   True) until the install task has stopped writing into them.
7. With ``store.save_decoded``, a finished request's chunks that hold generated tokens
   are saved into the shared store before its blocks are freed (:mod:`kvrelay.decode.saver`),
   so the next turn's prefill node loads the previous answer instead of computing it.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.core.config import KVRelayConfig
from kvrelay.core.connector_base import RelayConnector
from kvrelay.core.guard import count_refusal, verifier_for
from kvrelay.core.kv_namespace import kv_namespace, opaque_prompt
from kvrelay.core.params import ParamsError, ParamsRefusal, ParamsVerifier, PullParams
from kvrelay.core.tracing import traceparent_of
from kvrelay.decode.installer import InstallWorker
from kvrelay.decode.messages import DecodeMeta, LandedMeta
from kvrelay.decode.saver import SaveSpec, save_spec
from kvrelay.decode.specs import LoadSpec

log = logging.getLogger("vllm.kvrelay.decode")



class DecodeScheduler:
    def __init__(self, cfg: KVRelayConfig, verifier: ParamsVerifier | None = None) -> None:
        self.cfg = cfg
        self.verifier = verifier or verifier_for(cfg, producer=False)
        self._pending: dict[str, tuple[PullParams, int, bool]] = {}   # req -> (params, local tokens, now)
        self._landed: frozenset[str] = frozenset()              # transfers wholly received (the workers' last word)
        self._sync_landed = cfg.connector.sync_landed
        self._owner: dict[str, str] = {}                         # transfer id -> the request loading it
        self._params_of: dict[str, PullParams] = {}              # request -> its verified params
        self._loads: list[LoadSpec] = []
        self._cancelled: list[str] = []
        self._loading: set[str] = set()
        self._done: set[str] = set()
        self._saves: list[SaveSpec] = []
        self._saving: set[str] = set()
        self._save_decoded = cfg.store.enabled and cfg.store.save_decoded

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._done or rid in self._loading:
            return 0, False
        if opaque_prompt(request):               # keys would not name its images or embeddings: computed here
            self._done.add(rid)
            return 0, False
        try:
            params = self.verifier.check(request.kv_transfer_params)
            if isinstance(params, PullParams):
                if self._owner.setdefault(params.transfer_id, rid) != rid:
                    raise ParamsError(f"transfer {params.transfer_id!r} is already being loaded by another "
                                      "request", ParamsRefusal.REUSED)
                self._params_of[rid] = params
        except ParamsError as exc:        # the API-server guard answers most of these with a 400 first
            count_refusal(exc)
            log.warning("request %s: %s; computing the prompt locally", rid, exc)
            self._done.add(rid)
            return 0, False
        if not isinstance(params, PullParams):
            return 0, False
        n = len(request.prompt_token_ids) - params.tail - num_computed    # the tail is D's to compute
        if n <= 0:
            return 0, False
        now = self._install_now(params)
        self._pending[rid] = (params, num_computed, now)
        return n, not now

    def _install_now(self, params: PullParams) -> bool:
        """Install in this step (vLLM's sync load): the transfer has wholly landed on every rank
        and D computes at least one token itself (the tail), so the request can run at once."""
        return self._sync_landed and params.tail > 0 and params.transfer_id in self._landed

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        entry = self._pending.pop(rid, None)
        if entry is None or num_external == 0:
            return
        params, local, now = entry
        if not now:                               # in the background: vLLM waits for finished_recving
            self._loading.add(rid)
        self._done.add(rid)
        transferred = list(request.prompt_token_ids)[:len(request.prompt_token_ids) - params.tail]
        self._loads.append(LoadSpec(rid, params.transfer_id, transferred, list(blocks.get_block_ids()[0]), local,
                                    num_external, traceparent_of(request.kv_transfer_params), now,
                                    kv_namespace(request)))

    def build_meta(self, so: Any = None) -> DecodeMeta:
        idle = so is not None and so.total_num_scheduled_tokens == 0
        meta = DecodeMeta(loads=self._loads, cancelled=self._cancelled, saves=self._saves, idle=idle)
        self._loads, self._cancelled, self._saves = [], [], []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._pending.pop(rid, None)
        self._done.discard(rid)
        params = self._params_of.pop(rid, None)
        if params is not None and self._owner.get(params.transfer_id) == rid:
            del self._owner[params.transfer_id]
        if rid in self._loading:                  # aborted mid-load: the worker still writes its blocks
            self._cancelled.append(rid)
            return True, None
        saving = self._save_decoded and not opaque_prompt(request)
        spec = save_spec(request, block_ids, self.cfg.chunk_tokens, kv_namespace(request)) if saving else None
        if spec is None:
            return False, None
        self._saves.append(spec)                  # blocks stay until the worker has saved them
        self._saving.add(rid)
        return True, None

    def update_output(self, out: Any) -> None:
        meta = getattr(out, "kv_connector_worker_meta", None)
        if isinstance(meta, LandedMeta):
            self._landed = meta.landed
        for rid in out.finished_recving or ():
            self._loading.discard(rid)
        for rid in out.finished_sending or ():
            self._saving.discard(rid)

    def has_pending(self) -> bool:
        return bool(self._loading or self._cancelled or self._saving)

    def close(self) -> None:
        self.verifier.close()


class DecodeConnector(RelayConnector[InstallWorker]):
    """Consumer connector. Load with ``--kv-transfer-config '{"kv_connector": "DecodeConnector",
    "kv_connector_module_path": "kvrelay.decode.connector", "kv_role": "kv_consumer",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvrelay": {...}}}'``."""

    def make_scheduler(self, vllm_config: Any) -> DecodeScheduler:
        return DecodeScheduler(self.cfg)

    def make_worker(self, vllm_config: Any) -> InstallWorker:
        return InstallWorker(self.cfg, vllm_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and isinstance(meta, DecodeMeta):
            self._worker.start(meta.loads, meta.cancelled, meta.saves)

    def wait_for_save(self) -> None:
        return None

    def build_connector_worker_meta(self) -> LandedMeta | None:
        """Every step, what has landed (read by the scheduler's next ``get_num_new_matched_tokens``)."""
        if self._worker is None or not self.cfg.connector.sync_landed:
            return None
        return LandedMeta(self._worker.landed())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        recving = self._settled()
        return self._worker.take_saved() or None, recving
