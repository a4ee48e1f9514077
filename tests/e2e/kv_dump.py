"""The inspect hook the tensor-parallel tests install (``connector.inspect_hook``): each rank writes
a request's prompt KV blocks, as it holds them, to ``$KVRELAY_TEST_KV_DUMP/<role>-<rank>-<n>.pt``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

DUMP_ENV = "KVRELAY_TEST_KV_DUMP"


def dump(role: str, rank: int, req_id: str, layout: Any, block_ids: list[int]) -> None:
    where = os.environ.get(DUMP_ENV)
    if not where:
        return
    ids = torch.tensor(block_ids, dtype=torch.int64)
    planes = [t.view(torch.uint8).flatten(1) for t in layout.layers]        # [num_blocks, bpb] per layer
    data = torch.stack([p.index_select(0, ids) for p in planes])            # [L, n, bpb], a copy
    out = Path(where) / f"{role}-{rank}-{time.monotonic_ns()}.pt"
    torch.save({"role": role, "rank": rank, "req_id": req_id, "heads": layout.block_shape()[0], "kv": data},
               out.with_suffix(".tmp"))
    out.with_suffix(".tmp").rename(out)
