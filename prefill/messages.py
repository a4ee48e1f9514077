"""What the prefill node's scheduler half tells its worker half each step.

Same role as ``decode/messages.py``: one role's per-step connector metadata.

vLLM runs the two halves of a connector in different processes (the EngineCore and the
worker); these dataclasses travel between them in :class:`PrefillMeta`, vLLM's
``KVConnectorMetadata`` for this connector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.connector_base import RelayMeta


@dataclass
class PushSpec:
    """One push request's state for this step (scheduler -> worker)."""

    req_id: str
    transfer_id: str
    push_to: str
    prompt_len: int
    block_ids: list[int]
    ready: int                                   # prompt tokens whose KV exists after this step
    token_ids: list[int] | None = None           # sent once, with the first spec
    store_from: int = -1                         # store full chunks from this token on: the store's own hit (-1: none)
    early: bool = False                          # D registers after P answers: D grants without waiting
    traceparent: str = ""                        # the router's trace (core/tracing.py), with the first spec
    namespace: bytes = b""                       # the request's KV namespace (core/kv_namespace.py), with the first spec


@dataclass
class StoreLoad:
    """Load tokens [start, end) of a prompt from the store into its blocks, before this step's forward."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    namespace: bytes = b""     # the request's KV namespace (core/kv_namespace.py): its store keys


@dataclass
class PrefillMeta(RelayMeta):
    pushes: list[PushSpec] = field(default_factory=list)
    loads: list[StoreLoad] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)   # requests whose block free we delayed
    preempted: list[str] = field(default_factory=list)  # tracked requests vLLM preempted this step
