"""vLLM's stock NixlConnector with its two CPU-host pathologies switched off (bench baseline only).

As shipped, on a CPU host the NixlConnector worker (1) pins the calling thread - the
model's forward thread - to the last core of each NUMA node with
``os.sched_setaffinity``, and (2) creates its NIXL agent with a progress thread that
busy-polls a core. Both starve the model on a small host (~100x slower on 2 cores), so comparing
kvrelay only against the shipped connector would be unfair to it. This subclass
restores the thread's affinity after construction and creates the agent without the
progress thread (vLLM's connector polls transfer state every step anyway).

Load with ``{"kv_connector": "FairNixlConnector", "kv_connector_module_path":
"kvrelay.bench.fair_nixl", ...}``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector


class FairNixlConnector(NixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        affinity = os.sched_getaffinity(0)
        original = base_worker.nixl_agent_config
        if original is not None:
            # Scoped to this constructor: the worker builds its agent config inside it.
            base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            base_worker.nixl_agent_config = original
            os.sched_setaffinity(0, affinity)
