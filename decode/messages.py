"""The decode connector's per-step metadata, both ways.

Same role as ``prefill/messages.py``: one role's per-step connector metadata.

:class:`DecodeMeta` (scheduler -> workers, vLLM's ``KVConnectorMetadata``): loads to start,
transfers to cancel, saves. Built by the scheduler half in the EngineCore process and read by
the install thread in the worker process.

:class:`LandedMeta` (workers -> scheduler, vLLM's ``KVConnectorWorkerMetadata``): the transfers
wholly received on every rank, so the scheduler can install one inside the step that first
schedules its request instead of waiting a step for it in the background.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvrelay.core.connector_base import RelayMeta
from kvrelay.decode.saver import SaveSpec
from kvrelay.decode.specs import LoadSpec


@dataclass
class DecodeMeta(RelayMeta):
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True)
class LandedMeta(KVConnectorWorkerMetadata):
    """Transfer ids whose every chunk has landed intact on a rank and whose consumer has not
    finished with them (a background install may be under way). Each rank reports its whole
    current set every step; vLLM aggregates the ranks' reports, and a transfer counts as landed
    only where every rank has it (the intersection)."""

    landed: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LandedMeta)
        return LandedMeta(self.landed & other.landed)
