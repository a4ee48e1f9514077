"""The decode connector's per-step metadata: loads to start, transfers to cancel, saves.

Built by the scheduler half in the EngineCore process and read by the install thread in
the worker process; :class:`DecodeMeta` is the ``KVConnectorMetadata`` vLLM carries across.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.connector_base import RelayMeta
from kvrelay.decode.saver import SaveSpec


@dataclass
class LoadSpec:
    req_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]
    local_tokens: int          # D's own prefix-cache hit (block aligned): those blocks are not written
    num_tokens: int            # tokens to load = prompt_len - local_tokens
    traceparent: str = ""      # the router's trace (core/tracing.py): the install span's parent


@dataclass
class DecodeMeta(RelayMeta):
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
