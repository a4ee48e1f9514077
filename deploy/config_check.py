"""``kvrelay config --check``: every check the router and ``kvrelay up`` run before they start.

A config that lists nodes (``router.prefill``, ``router.decode``) is checked as the router's;
one that does not is checked as ``kvrelay up``'s, which fills the node lists and makes a
secret when none is set, and must fit its servers' ports without collisions. Either way, on a
GPU host each role's pool of ``deploy.prefill`` / ``deploy.decode`` nodes must fit the visible
devices (:mod:`kvrelay.deploy.devices`).
"""

from __future__ import annotations

import os

from kvrelay.common.config_fields import parse_size
from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import SECRET_ENV
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.core.config import KVRelayConfig, RoutingPolicy
from kvrelay.core.engine_compat import facts_from_args, pair_refusals, read_hf_config
from kvrelay.core.ranks import Sharding
from kvrelay.deploy.devices import pool_problems, visible_gpus
from kvrelay.deploy.launch import PUBLISH_OFFSET, Role, kv_events_port, node_specs
from kvrelay.router import preflight as router_preflight
from kvrelay.transport.config import TransportKind
from kvrelay.transport.pool import receive_pool_bytes

TCP_DATA_OFFSET = 100      # the tcp backend's data port, unless transport.data_port: control port + 100


def stack_ports(cfg: KVRelayConfig) -> dict[str, int]:
    """Every port a ``kvrelay up`` stack listens on, by what listens ({name: port})."""
    ports = {"router.port": cfg.router.port}
    base = cfg.deploy.base_port
    for spec in node_specs(cfg):
        ports[f"{spec.name} HTTP"] = spec.port
        for r in range(spec.tp if spec.role is Role.DECODE else 0):     # rank r: each port + r
            rank = f" rank {r}" if spec.tp > 1 else ""
            ports[f"{spec.name}{rank} transfer control"] = spec.kv_port + r
            if cfg.transport.backend is TransportKind.TCP:
                data = cfg.transport.data_port or spec.kv_port + TCP_DATA_OFFSET
                ports[f"{spec.name}{rank} transfer data"] = data + r
        if cfg.connector.metrics_port:
            ports[f"{spec.name} connector metrics"] = cfg.connector.metrics_port + spec.port - base
        if spec.role is Role.PREFILL and cfg.store.enabled and cfg.router.policy is RoutingPolicy.CACHE_AWARE:
            publish = cfg.store.publish_port or cfg.deploy.kv_base_port + PUBLISH_OFFSET
            ports[f"{spec.name} store events"] = publish + spec.index
        if cfg.router.decode_first is not False:      # kvrelay up wires the events unless it is off
            ports[f"{spec.name} KV events"] = kv_events_port(cfg, spec)
    return ports


def _collisions(cfg: KVRelayConfig) -> list[str]:
    seen: dict[int, str] = {}
    found = []
    for name, port in stack_ports(cfg).items():
        if port in seen:
            found.append(f"port {port} is both {seen[port]} and {name}: move deploy.base_port, "
                         "deploy.kv_base_port, router.port or connector.metrics_port apart")
        seen.setdefault(port, name)
    return found


def _tp_problems(cfg: KVRelayConfig) -> list[str]:
    """TP sizes the model's heads do not allow (read from a local model directory's config.json;
    a hub id is checked by each engine at start)."""
    hf = read_hf_config(cfg.engine.model)
    if not hf:
        return []
    heads = int(hf.get("num_attention_heads") or 0)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    found = []
    for key, tp in (("engine.prefill_tp", cfg.engine.prefill_tp), ("engine.decode_tp", cfg.engine.decode_tp)):
        if heads and heads % tp:
            found.append(f"{key} {tp} does not divide the model's {heads} attention heads")
            continue
        try:
            Sharding(kv_heads, tp)
        except ConfigError as exc:
            found.append(f"{key}: {exc}")
    return found


def engine_problems(cfg: KVRelayConfig) -> list[str]:
    """Engine configurations the PD pair cannot serve exactly (:mod:`kvrelay.core.engine_compat`),
    read from ``engine.*`` and the model's ``config.json``, and a receive pool too small for them."""
    e = cfg.engine
    hf = read_hf_config(e.model)
    dtype = [] if e.dtype == "auto" else ["--dtype", e.dtype]       # what launch.server_command passes first
    pair = pair_refusals(facts_from_args([*dtype, *e.extra_args, *e.prefill_args], hf),
                         facts_from_args([*dtype, *e.extra_args, *e.decode_args], hf), cfg.chunk_tokens)
    return [f"engine: {r} (kvrelay refuses configurations it cannot serve exactly: docs/guide/compatibility.md)"
            for r in pair] + _receive_pool_problems(cfg, hf)


DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def _receive_pool_problems(cfg: KVRelayConfig, hf: dict) -> list[str]:
    """A configured ``transport.pool_bytes`` that cannot hold one prompt of the context length,
    from a local model's ``config.json`` (each decode rank holds its heads' share)."""
    pool = parse_size(cfg.transport.pool_bytes, "transport.pool_bytes")
    layers, heads = int(hf.get("num_hidden_layers") or 0), int(hf.get("num_attention_heads") or 0)
    if not pool or not layers or not heads or "kv_lora_rank" in hf:
        return []                                   # auto-sized, or nothing to size it by (MLA: a latent)
    kv_heads = max(1, int(hf.get("num_key_value_heads") or heads) // cfg.engine.decode_tp)
    head_dim = int(hf.get("head_dim") or int(hf.get("hidden_size") or 0) // heads)
    dtype = cfg.engine.dtype if cfg.engine.dtype != "auto" else str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    per_token = 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)
    max_len = cfg.engine.max_model_len or int(hf.get("max_position_embeddings") or 4096)
    try:
        receive_pool_bytes(pool, HEADER_SIZE + cfg.chunk_tokens * per_token, max_len, cfg.chunk_tokens)
    except ConfigError as exc:
        return [str(exc)]
    return []


def problems(cfg: KVRelayConfig) -> list[str]:
    """Every reason the router (or ``kvrelay up``) would refuse ``cfg``; empty when it would start."""
    if cfg.router.prefill or cfg.router.decode:
        return router_preflight.problems(cfg) + engine_problems(cfg) + pool_problems(cfg, visible_gpus())
    skip = {"nodes", "cache_aware"}                # kvrelay up lists the nodes and their event ports
    if not (os.environ.get(SECRET_ENV) or cfg.transport.secret_file):
        skip.add("secret")                         # kvrelay up writes one into deploy.log_dir
    return (router_preflight.problems(cfg, frozenset(skip)) + _collisions(cfg) + _tp_problems(cfg)
            + engine_problems(cfg) + pool_problems(cfg, visible_gpus()))
