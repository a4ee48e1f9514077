"""What the decode worker half is asked to do, one request at a time: a load.

Same role as ``prefill/specs.py``: one role's per-request work orders, free of vLLM, which the
scheduler half sends in its per-step metadata (:mod:`kvrelay.decode.messages`) and the worker
half (:mod:`kvrelay.decode.installer`) carries out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoadSpec:
    req_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]
    local_tokens: int          # D's own prefix-cache hit (block aligned): those blocks are not written
    num_tokens: int            # tokens to load = prompt_len - local_tokens
    traceparent: str = ""      # the router's trace (core/tracing.py): the install span's parent
    now: bool = False          # every chunk had landed: install before this step's forward (vLLM sync load)
    namespace: bytes = b""     # the request's KV namespace (core/kv_namespace.py): part of every transfer key
