"""What the prefill node's scheduler half tells its worker half each step.

Same role as ``decode/messages.py``: one role's per-step connector metadata.

vLLM runs the two halves of a connector in different processes (the EngineCore and the
worker); these dataclasses travel between them in :class:`PrefillMeta`, vLLM's
``KVConnectorMetadata`` for this connector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.connector_base import RelayMeta
from kvrelay.prefill.specs import PushSpec, StoreLoad


@dataclass
class PrefillMeta(RelayMeta):
    pushes: list[PushSpec] = field(default_factory=list)
    loads: list[StoreLoad] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)   # requests whose block free we delayed
    preempted: list[str] = field(default_factory=list)  # tracked requests vLLM preempted this step
