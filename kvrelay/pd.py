"""What the router, the prefill connector and the decode connector share.

* ``kv_transfer_params`` schema (versioned, validated): the router puts
  ``{"kvrelay": {...}}`` into both requests of a PD pair.
* The connector config (``kv_connector_extra_config = {"kvrelay": <config tree>}``).
* The engine fingerprint both ends must agree on.
* The per-node event log (JSONL) and Prometheus metrics of the connectors.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from kvrelay import config as kcfg
from kvrelay.config import KVRelayConfig

PARAMS_KEY = "kvrelay"
PARAMS_VERSION = 1


class PushParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="push", tag_field="role"):
    """For the prefill node: compute the prompt and push its chunks to ``push_to``."""

    transfer_id: str
    push_to: str                 # the decode node's transfer control endpoint, tcp://host:port
    v: int = PARAMS_VERSION


class PullParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="pull", tag_field="role"):
    """For the decode node: the prompt's KV arrives from a prefill node under ``transfer_id``."""

    transfer_id: str
    pull_from: str = ""          # informational: the prefill node's URL
    v: int = PARAMS_VERSION


Params = PushParams | PullParams


class ParamsError(ValueError):
    """Malformed ``kv_transfer_params``."""


def parse_params(kv_transfer_params: dict[str, Any] | None) -> Params | None:
    """Extract kvrelay's params from a request's ``kv_transfer_params`` (None if absent)."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    try:
        params = msgspec.convert(kv_transfer_params[PARAMS_KEY], Params)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"invalid kv_transfer_params.{PARAMS_KEY}: {exc}") from exc
    if params.v != PARAMS_VERSION:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} version {params.v}; this node speaks "
                          f"{PARAMS_VERSION}")
    if not params.transfer_id:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.transfer_id is empty")
    return params


def params_dict(params: Params) -> dict[str, Any]:
    return {PARAMS_KEY: msgspec.to_builtins(params)}


def connector_config(vllm_config: Any) -> KVRelayConfig:
    """The kvrelay config tree carried in ``kv_connector_extra_config["kvrelay"]``."""
    extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    unknown = set(extra) - {PARAMS_KEY}
    if unknown:
        raise kcfg.ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; "
                               f"put the kvrelay config tree under {PARAMS_KEY!r}")
    return kcfg.from_dict(extra.get(PARAMS_KEY))


class EventLog:
    """Append-only JSONL of connector events (thread-safe; no-op when path is empty)."""

    def __init__(self, path: str, node: str) -> None:
        self._path = path
        self._node = node
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if not self._path:
            return
        line = json.dumps({"t": time.time(), "node": self._node, "event": event, **fields})
        with self._lock, open(self._path, "a") as f:
            f.write(line + "\n")


class Metrics:
    """The connectors' Prometheus metrics (one set per process)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        buckets = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10)
        self.tokens_loaded = Counter("kvrelay_tokens_loaded", "Prompt tokens installed from pushed chunks")
        self.tokens_recomputed = Counter("kvrelay_tokens_recomputed",
                                         "Prompt tokens recomputed after a failed chunk (fallback)")
        self.chunks = Counter("kvrelay_chunks", "Chunks by side and outcome", ["side", "outcome"])
        self.bytes = Counter("kvrelay_bytes", "Payload bytes moved", ["side"])
        self.forced_frees = Counter("kvrelay_push_forced_frees",
                                    "Prefill requests whose blocks were freed at the deadline")
        self.load_latency = Histogram("kvrelay_chunk_load_latency_seconds",
                                      "Chunk arrival to installed in the engine's KV cache", buckets=buckets)
        self.store_latency = Histogram("kvrelay_chunk_store_latency_seconds",
                                       "Chunk ready on prefill to push complete", buckets=buckets)
        self.transfer_latency = Histogram("kvrelay_transfer_latency_seconds",
                                          "Decode: request scheduled to last chunk installed", buckets=buckets)
        self.store_stored = Counter("kvrelay_store_chunks_stored", "Chunks put into the store")
        self.store_loaded_tokens = Counter("kvrelay_store_tokens_loaded",
                                           "Prompt tokens loaded from the store instead of computed")
        self.inflight = Gauge("kvrelay_transfers_inflight", "Transfers in flight", ["side"])
        self.pool_leased = Gauge("kvrelay_pool_slots_busy", "Receive pool slots leased, filled or held")


@functools.cache
def metrics(port: int = 0) -> Metrics:
    """The process's metrics; starts an exporter on ``port`` the first time if non-zero."""
    m = Metrics()
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
    return m


def engine_fingerprint(vllm_config: Any, layout: Any) -> Any:
    """What makes KV bytes exchangeable between two engines (see transport.keys.Fingerprint)."""
    from transport.keys import Fingerprint

    pc = vllm_config.parallel_config
    return Fingerprint(model=str(vllm_config.model_config.model), dtype=str(layout.dtype),
                       kv_layout=f"{layout.device.type}:{list(layout.block_shape())}",
                       block_size=vllm_config.cache_config.block_size, num_layers=layout.num_layers,
                       bytes_per_block=layout.bytes_per_block, tp_rank=getattr(pc, "rank", 0),
                       tp_size=pc.tensor_parallel_size)


def _allowed_cpus() -> set[int]:
    """Every CPU this container/cgroup may use (not just the calling thread's pinned set)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def place_helper_thread(policy: str) -> None:
    """Set the calling helper thread's CPU affinity (``connector.helper_cpus``).

    vLLM's CPU worker pins its forward thread (and so every thread it creates) to the
    cores it computes on; a push/install thread that inherits that pin time-slices with
    the model instead of using an idle core. ``all`` lets the helper run on any CPU the
    container allows, ``inherit`` keeps the engine's pin, anything else is a CPU list
    like ``"2-3"``. Only the helper thread is affected - never the engine's threads.
    """
    if policy == "inherit" or not hasattr(os, "sched_setaffinity"):
        return
    if policy == "all":
        cpus = _allowed_cpus()
    else:
        cpus = set()
        for part in policy.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    try:
        os.sched_setaffinity(0, cpus)             # 0 = the calling thread on Linux
    except OSError as exc:
        logging.getLogger("vllm.kvrelay").warning("helper_cpus=%r not applied: %s", policy, exc)
