"""One typed configuration tree, loaded from YAML and overridden by CLI flags.

Every section is a frozen ``msgspec.Struct`` that forbids unknown fields, so a
typo such as ``pool_byte:`` is an error that names the key instead of a
silently ignored setting. Sizes accept integers or strings with a binary or
decimal suffix (``"256MiB"``, ``"1GB"``). Durations are seconds (float).

Precedence: built-in defaults < YAML file < ``--section.field=value`` flags.
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

MiB = 1 << 20


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key."""


class TransportKind(str, enum.Enum):
    NIXL = "nixl"
    TCP = "tcp"
    SHM = "shm"
    UCX = "ucx"


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"


class LoadFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"   # failed chunks are recomputed by the decode engine (vLLM's load-error path)
    FAIL = "fail"             # the request fails with an error


class RoutingPolicy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    CACHE_AWARE = "cache_aware"       # prefill: the node holding the longest cached prefix, weighed by load


class NixlErrorMode(str, enum.Enum):
    NONE = "none"
    PEER = "peer"


Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Size = int | str

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(value: int | str, key: str = "size") -> int:
    """``"256MiB"`` -> 268435456. Raises :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(value)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{key}: cannot parse size {value!r} (try 1048576, '1MiB' or '1MB')")
    return int(float(m.group(1)) * _UNITS[unit])


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if name.endswith("_bytes"):
                value = getattr(self, name)
                msgspec.structs.force_setattr(self, name, parse_size(value, name))


class TimeoutConfig(_Section, frozen=True):
    """All deadlines of the transport, in seconds."""

    lease_s: Seconds = 10.0          # a slot not filled+consumed within this is reclaimed
    alloc_wait_s: Seconds = 5.0      # back-pressure: how long Alloc waits for free slots
    peer_s: Seconds = 3.0            # no heartbeat/traffic for this long -> peer declared dead
    heartbeat_s: Seconds = 0.5       # sender heartbeat interval
    connect_s: Seconds = 5.0         # control-plane handshake deadline
    chunk_s: Seconds = 10.0          # one chunk write must complete within this


class TransportConfig(_Section, frozen=True):
    """The data plane and the decode node's receive pool."""

    backend: TransportKind = TransportKind.NIXL
    pool_bytes: Size = 256 * MiB
    host: str = "127.0.0.1"
    control_port: Port = 0           # 0 = pick a free port
    data_port: Port = 0              # tcp backend listener; 0 = pick a free port
    numa_node: int | str = "auto"    # "auto": the GPU's NUMA node if any, else no-op
    nixl_error_mode: NixlErrorMode = NixlErrorMode.NONE
    shared_secret: str = "kvrelay-dev-secret"   # HMAC key for Hello; set per deployment
    max_message_bytes: Positive = 1 * MiB       # control frames above this are rejected

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.numa_node, str) and self.numa_node != "auto":
            raise ConfigError(f"numa_node: expected 'auto' or a node index, got {self.numa_node!r}")
        if isinstance(self.numa_node, int) and self.numa_node < 0:
            raise ConfigError(f"numa_node: must be >= 0, got {self.numa_node}")


class StoreConfig(_Section, frozen=True):
    """The multi-tier KV store (CPU / disk / Redis)."""

    enabled: bool = False            # prefill nodes store computed chunks and load stored prefixes
    cpu_bytes: Size = 1024 * MiB
    deferred_bytes: Size = 8 * MiB
    prefetch_ahead: NonNeg = 2
    lookup_timeout_s: Seconds = 2.0  # the scheduler's prefix lookup; slower than this = a miss (computed)
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    disk_path: str = ""
    disk_bytes: Size = 0
    redis_url: str = ""
    publish_port: Port = 0           # ZeroMQ PUB of chunk stored/evicted events for the router (0 = off)
    save_decoded: bool = False       # decode nodes store the chunks their generated tokens complete (Redis)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.enabled and self.save_decoded and not self.redis_url:
            raise ConfigError("store.save_decoded: prefill nodes can only find a decode node's chunks in a "
                              "shared tier; set store.redis_url")


class ConnectorConfig(_Section, frozen=True):
    """The vLLM connectors (prefill pushes, decode installs)."""

    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    first_chunk_s: Seconds = 30.0    # decode: how long to wait for a transfer's first chunk
    free_deadline_s: Seconds = 30.0  # prefill: blocks held for a push are freed after this anyway
    events_path: str = ""            # JSONL of per-request transfer events ("" = off)
    metrics_port: Port = 0           # Prometheus exporter of the worker process (0 = off)
    fault_corrupt_every: NonNeg = 0  # testing: flip a byte in every Nth pushed chunk (0 = never)
    helper_cpus: str = "all"         # push/install threads: "all" allowed CPUs, "inherit" the engine pin, or "2-3"


class EngineConfig(_Section, frozen=True):
    """How `kvrelay up` and the pool launchers start vLLM."""

    model: str = ""                  # HF id or local path; "" = the built-in tiny model
    tiny_model_dir: str = "~/.cache/kvrelay/tiny-model"
    served_model_name: str = ""      # "" = the model path (vLLM's default); the tiny model: kvrelay-tiny
    dtype: str = "auto"              # vLLM --dtype; "auto" = the model's (float32 for the tiny model)
    max_model_len: Positive = 4096
    prefill_args: list[str] = msgspec.field(default_factory=list)  # extra vLLM args, prefill nodes only
    decode_args: list[str] = msgspec.field(default_factory=list)   # extra vLLM args, decode nodes only
    kv_cache_gib: Positive = 1       # VLLM_CPU_KVCACHE_SPACE on CPU hosts
    cpu_bind: str = "split"          # CPU hosts: "split" the cores among the servers, "vllm" = vLLM's
                                     # default, or a VLLM_CPU_OMP_THREADS_BIND value used for every server
    extra_args: list[str] = msgspec.field(default_factory=list)   # appended to every vLLM command line


class RouterConfig(_Section, frozen=True):
    """The OpenAI-compatible router and the pools it balances."""

    host: str = "127.0.0.1"
    port: Port = 8000
    policy: RoutingPolicy = RoutingPolicy.ROUND_ROBIN
    tokenizer: str = ""              # cache_aware: tokenizer (model path) used to compute chunk keys
    load_weight: float = 1.0         # cache_aware: chunks of cache hit one outstanding request is worth
    prefill: list[str] = msgspec.field(default_factory=list)   # http://host:port of prefill servers
    decode: list[str] = msgspec.field(default_factory=list)    # "http://host:port=tcp://host:kvport"
    health_interval_s: Seconds = 2.0
    request_timeout_s: Seconds = 600.0


class DeployConfig(_Section, frozen=True):
    """`kvrelay up`: a local stack of N prefill + M decode servers and a router."""

    prefill: Positive = 1
    decode: Positive = 1
    host: str = "127.0.0.1"
    base_port: Port = 8100           # vLLM servers listen on base_port, base_port+1, ...
    kv_base_port: Port = 9100        # decode node i's transfer control port (+100 for tcp data)
    log_dir: str = "kvrelay-logs"
    startup_timeout_s: Seconds = 600.0


class KVRelayConfig(_Section, frozen=True):
    """The root of the tree."""

    chunk_tokens: Positive = 256
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    deploy: DeployConfig = msgspec.field(default_factory=DeployConfig)


def _convert(data: Mapping[str, Any]) -> KVRelayConfig:
    try:
        return msgspec.convert(dict(data), KVRelayConfig, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc).replace("`$.", "`").replace("`$`", "`<root>`")
        raise ConfigError(f"invalid config: {msg}") from exc


def from_dict(data: Mapping[str, Any] | None) -> KVRelayConfig:
    """Build and validate a config from nested plain data."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid config: top level must be a mapping, got {type(data).__name__}")
    return _convert(data)


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> KVRelayConfig:
    """Defaults < YAML at ``path`` < ``key.sub=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"invalid config {path}: top level must be a mapping")
        data = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw else "")
    return from_dict(data)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def leaf_fields(cls: type[msgspec.Struct] = KVRelayConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``("transport.pool_bytes", default)`` for every leaf of the tree."""
    defaults = cls()
    for name in cls.__struct_fields__:
        value = getattr(defaults, name)
        if isinstance(value, msgspec.Struct):
            yield from leaf_fields(type(value), f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


FIELD_HELP: dict[str, str] = {
    'chunk_tokens': 'tokens per pushed chunk; a multiple of the engine block size',
    'transport.backend': 'data plane: nixl (UCX one-sided WRITE), tcp, shm (same host) or ucx',
    'transport.pool_bytes': "decode node's pinned receive pool (e.g. 256MiB)",
    'transport.host': "address the decode node's transfer endpoint binds to",
    'transport.control_port': "decode node's ZeroMQ control port (0 = any free port)",
    'transport.data_port': "tcp backend's data listener port (0 = any free port)",
    'transport.numa_node': "NUMA node for the pool: auto = the GPU's node, else no-op; or an index",
    'transport.nixl_error_mode': 'UCX error handling for nixl: none or peer (same on both sides)',
    'transport.shared_secret': 'HMAC key that authenticates Hello; set one per deployment',
    'transport.max_message_bytes': 'control frames larger than this are rejected',
    'timeouts.lease_s': 'a slot not filled and consumed within this is reclaimed (seconds)',
    'timeouts.alloc_wait_s': 'back-pressure: how long an Alloc may wait for free slots',
    'timeouts.peer_s': 'a sender silent this long is declared dead; its transfers fail',
    'timeouts.heartbeat_s': 'sender heartbeat interval',
    'timeouts.connect_s': 'control-plane handshake deadline',
    'timeouts.chunk_s': 'one chunk write must complete (and the next chunk arrive) within this',
    'store.enabled': 'prefill nodes keep computed chunks in the store and load stored prompt prefixes instead of computing them',
    'store.cpu_bytes': 'multi-tier store: CPU tier capacity',
    'store.deferred_bytes': 'multi-tier store: batch-and-defer buffer for new chunks',
    'store.prefetch_ahead': 'multi-tier store: chunks prefetched ahead of the one installing',
    'store.lookup_timeout_s': ("prefill scheduler: a store prefix lookup that takes longer than this counts as a miss "
                               "(the prompt is computed); the engine's step waits for it, so keep it short"),
    'store.eviction_policy': 'multi-tier store: lru, lfu or fifo',
    'store.disk_path': 'multi-tier store: disk tier directory ("" = no disk tier)',
    'store.disk_bytes': 'multi-tier store: disk tier size cap',
    'store.publish_port': 'prefill nodes publish chunk stored/evicted events here (ZeroMQ PUB) for cache-aware routing; 0 = off',
    'store.redis_url': 'multi-tier store: redis://host:port/db ("" = no Redis tier)',
    'store.save_decoded': ('decode nodes also store the chunks completed by generated tokens (into store.redis_url, '
                           'which the prefill nodes share), so the next turn finds the previous answer'),
    'connector.load_failure_policy': 'decode: a failed chunk is recomputed (recompute) or fails the request (fail)',
    'connector.first_chunk_s': "decode: wait this long for a transfer's first chunk, then recompute",
    'connector.free_deadline_s': 'prefill: blocks held for a push are freed after this anyway (counted)',
    'connector.events_path': 'JSONL log of per-chunk and per-request transfer events ("" = off; kvrelay up: log_dir/events.jsonl)',
    'connector.metrics_port': 'Prometheus exporter of each worker (node i: port + i; 0 = off)',
    'connector.helper_cpus': "push/install threads' CPUs: all (any CPU the container allows), inherit (the engine thread's pin) or a list like 2-3",
    'connector.fault_corrupt_every': 'testing only: corrupt every Nth pushed chunk after checksumming (0 = never)',
    'engine.model': 'HF model id or local path ("" = the built-in tiny model)',
    'engine.tiny_model_dir': 'where the tiny model is created on first use',
    'engine.served_model_name': 'model name clients use ("" = the model path; kvrelay-tiny for the tiny model)',
    'engine.dtype': 'vLLM --dtype (auto; the tiny model runs in float32)',
    'engine.max_model_len': 'vLLM --max-model-len',
    'engine.prefill_args': 'extra vLLM arguments for prefill nodes only (YAML list)',
    'engine.decode_args': 'extra vLLM arguments for decode nodes only (YAML list)',
    'engine.kv_cache_gib': 'CPU hosts: KV cache size per server in GiB (VLLM_CPU_KVCACHE_SPACE)',
    'engine.cpu_bind': 'CPU hosts: split the cores among the servers, vllm (its default), or a VLLM_CPU_OMP_THREADS_BIND value',
    'engine.extra_args': 'extra vLLM arguments for every server (YAML list)',
    'router.host': 'router listen address',
    'router.port': 'router port (OpenAI API at /v1)',
    'router.policy': 'node choice: round_robin, least_outstanding or cache_aware (prefill: longest cached prefix, weighed by load)',
    'router.tokenizer': 'cache_aware: tokenizer (model path) for computing chunk keys (kvrelay up sets it)',
    'router.load_weight': 'cache_aware: how many cached chunks one outstanding request on a node is worth',
    'router.prefill': "prefill node URLs, e.g. '[http://h1:8100]', or 'http://h1:8100=tcp://h1:9300' with the node's store event port (kvrelay up fills this in)",
    'router.decode': "decode nodes as 'http://host:port=tcp://host:kvport' (kvrelay up fills this in)",
    'router.health_interval_s': 'health-check period; failed nodes leave rotation until healthy',
    'router.request_timeout_s': 'upstream request timeout',
    'deploy.prefill': 'kvrelay up: number of prefill servers',
    'deploy.decode': 'kvrelay up: number of decode servers',
    'deploy.host': 'kvrelay up: address every server binds to',
    'deploy.base_port': 'kvrelay up: first vLLM HTTP port (prefill nodes first, then decode)',
    'deploy.kv_base_port': 'kvrelay up: decode node i receives chunks on kv_base_port + i (tcp data + 100)',
    'deploy.log_dir': 'kvrelay up: server logs and events.jsonl',
    'deploy.startup_timeout_s': 'kvrelay up: how long servers may take to become healthy',
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and one ``--section.field`` flag per leaf to ``parser``."""
    group = parser.add_argument_group("configuration (YAML keys; flags override the file)")
    group.add_argument("--config", metavar="FILE", help="deployment YAML")
    for key, default in leaf_fields():
        shown = default.value if isinstance(default, enum.Enum) else default
        group.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="V", default=None,
                           help=f"{FIELD_HELP.get(key, '')} (default: {shown})".strip())


def config_from_args(args: argparse.Namespace) -> KVRelayConfig:
    overrides = [f"{k[4:]}={v}" for k, v in vars(args).items() if k.startswith("cfg:") and v is not None]
    return load(getattr(args, "config", None), overrides)


def to_dict(cfg: KVRelayConfig) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(cfg)
    return data
