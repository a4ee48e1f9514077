"""What the prefill and decode connectors share: the vLLM hook plumbing and the worker basics.

vLLM instantiates a connector twice, in two processes: once with the SCHEDULER role
(EngineCore) and once with the WORKER role (the model runner). :class:`RelayConnector`
builds the role's half (``make_scheduler`` / ``make_worker``) and routes every hook to
it. Hooks a role never receives assert that its half exists.

Contract of the halves:

* scheduler half: ``matched(request, num_computed) -> (tokens, async)``,
  ``after_alloc(request, blocks, n)``, ``build_meta(scheduler_output) -> RelayMeta``,
  ``request_finished(request, block_ids) -> (delay_free, params)``, ``update_output(out)``,
  ``has_pending() -> bool`` (keep the engine stepping);
* worker half (:class:`~kvrelay.core.worker_base.WorkerBase`, which needs no vLLM):
  ``register(kv_caches)``, ``take_finished()``, ``take_errors()``,
  ``wait_for_progress(timeout)``, ``close()``; the subclass connector decides what
  ``start_load_kv`` / ``wait_for_save`` do with the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvrelay.common.errors import EngineIncompatible
from kvrelay.core.config import from_connector_extra
from kvrelay.core.engine_compat import Refusal, facts_from_vllm, refusals
from kvrelay.core.engine_stats import RelayPromMetrics, RelayStats, StatsTracker
from kvrelay.core.worker_base import WorkerBase, WorkerHalf

# While every request only waits on transfers, vLLM steps the engine back to back with
# empty steps. In such a step ``get_finished`` waits up to this long for a transfer to
# settle (returning at once when one does): a few hundred steps per second instead of
# thousands, CPU a co-located engine gets back.
IDLE_WAIT_S = 0.003
@dataclass
class RelayMeta(KVConnectorMetadata):
    idle: bool = False          # the engine scheduled no tokens this step


class SchedulerHalf(Protocol):
    """The scheduler half (EngineCore process). Every method runs on vLLM's scheduler thread
    and must not block on the network."""

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """``(external tokens, load asynchronously?)`` for a request being scheduled."""
        ...

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Blocks were allocated for the request (record its block ids)."""
        ...

    def build_meta(self, so: Any) -> KVConnectorMetadata:
        """This step's work for the worker half."""
        ...

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``(delay freeing the blocks?, kv_transfer_params for the response)``."""
        ...

    def update_output(self, out: Any) -> None:
        """The worker half's per-step output (finished transfers)."""
        ...

    def has_pending(self) -> bool:
        """True while transfers are in flight (keeps the engine stepping)."""
        ...

    def close(self) -> None:
        """Stop what it started (threads, sockets); the engine is shutting down."""
        ...


W = TypeVar("W", bound=WorkerHalf)


def refuse_incompatible(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise :class:`EngineIncompatible` for an engine configuration kvrelay cannot serve exactly
    (:mod:`kvrelay.core.engine_compat`): the engine fails at start, never at a request."""
    found = refusals(facts_from_vllm(vllm_config))
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        found.append(Refusal(f"{len(groups)} KV-cache groups (hybrid KV-cache manager)",
                             "kvrelay moves one group's blocks; start vLLM with --disable-hybrid-kv-cache-manager"))
    if found:
        raise EngineIncompatible("kvrelay cannot serve this engine configuration exactly: "
                                 + "; ".join(map(str, found)))


class RelayConnector(KVConnectorBase_V1, Generic[W]):
    """Routes vLLM's hooks to the scheduler half or the worker half of one connector. An engine
    configuration it cannot serve exactly is refused here, when vLLM builds it."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        refuse_incompatible(vllm_config, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = from_connector_extra(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
        self._sched = self.make_scheduler(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = self.make_worker(vllm_config) if role == KVConnectorRole.WORKER else None
        self._stats = StatsTracker(self._worker.metrics) if isinstance(self._worker, WorkerBase) else None   # on /metrics
        self._ship_stats = False

    def make_scheduler(self, vllm_config: Any) -> SchedulerHalf:
        """Build the scheduler half (called once, in the EngineCore process)."""
        raise NotImplementedError

    def make_worker(self, vllm_config: Any) -> W:
        """Build the worker half (called once, in the model-runner process)."""
        raise NotImplementedError

    def _meta(self) -> Any:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._sched is not None
        result: tuple[int, bool] = self._sched.matched(request, num_computed_tokens)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        meta: KVConnectorMetadata = self._sched.build_meta(scheduler_output)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        result: tuple[bool, dict[str, Any] | None] = self._sched.request_finished(request, block_ids)
        return result

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and bool(self._sched.has_pending())

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def _settled(self) -> set[str] | None:
        """Requests whose transfers settled; in an idle step, first wait briefly for one."""
        assert self._worker is not None
        meta = self._meta()
        if isinstance(meta, RelayMeta) and meta.idle:
            self._worker.wait_for_progress(IDLE_WAIT_S)
        done: set[str] = self._worker.take_finished()
        self._ship_stats = self._ship_stats or bool(done)    # a transfer settled: its numbers go out this step
        return done or None

    # ---------------------------------------------------------------- stats (core/engine_stats.py)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: what changed in this process's metrics since the last step (None: nothing)."""
        if self._stats is None:
            return None
        force, self._ship_stats = self._ship_stats, False
        return self._stats.delta(force)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return RelayStats(data=data) if data is not None else RelayStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return RelayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
