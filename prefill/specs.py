"""What the prefill worker half is asked to do, one request at a time: a push and a store load.

Same role as ``decode/specs.py``: one role's per-request work orders, free of vLLM, which the
scheduler half sends in its per-step metadata (:mod:`kvrelay.prefill.messages`) and the worker
half (:mod:`kvrelay.prefill.pusher`) carries out.
"""

from __future__ import annotations

from dataclasses import dataclass


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
