"""One typed configuration tree, loaded from YAML and overridden by CLI flags.

Same role as ``transport/config.py`` and ``store/config.py``: a room's own config sections (this one also composes the tree).

Each section is owned by the package that reads it: ``transport`` and ``timeouts``
by :mod:`kvrelay.transport.config`, ``store`` by :mod:`kvrelay.store.config`; this module
owns the engine-side sections (``connector``, ``engine``) and the local launcher's, the
router's is :mod:`kvrelay.core.router_config`; it composes them into :class:`KVRelayConfig`.
The router's and the launcher's sections live in the core rather than in their packages
because the one tree travels whole to every connector (``kv_connector_extra_config``),
and the core sits below the router and the operator tools.

Every section forbids unknown fields, so a typo such as ``pool_byte:`` is an error
that names the key instead of a silently ignored setting.

Precedence: built-in defaults < YAML file < ``--section.field=value`` flags.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import functools
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import yaml

from kvrelay.common import numa
from kvrelay.common.config_fields import NonNeg, Port, Positive, Seconds, Section
from kvrelay.common.errors import ConfigError
from kvrelay.core import router_config as rcfg
from kvrelay.core.engine_args import TP_FLAGS, parallel_flag
from kvrelay.core.logs import LogFormat
from kvrelay.core.router_config import FirstToken, RouterConfig, RoutingPolicy
from kvrelay.core.tracing import TraceProtocol
from kvrelay.store import config as scfg
from kvrelay.store.config import StoreConfig
from kvrelay.transport import config as tcfg
from kvrelay.transport.config import TimeoutConfig, TransportConfig

__all__ = ["ConfigError", "FirstToken", "KVRelayConfig", "RouterConfig", "RoutingPolicy", "add_config_args",
           "config_from_args", "engine_view", "from_dict", "load", "to_dict", "without_secrets"]


class LoadFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"   # failed chunks are recomputed by the decode engine (vLLM's load-error path)
    FAIL = "fail"             # the request fails with an error


class ConnectorConfig(Section, frozen=True):
    """The vLLM connectors (prefill pushes, decode installs)."""

    first_chunk_s: Seconds = 30.0    # decode: how long to wait for a transfer's first chunk
    free_deadline_s: Seconds = 30.0  # prefill: blocks held for a push are freed after this anyway
    events_path: str = ""            # JSONL of per-request transfer events ("" = off)
    metrics_port: Port = 0           # Prometheus exporter of the worker process (0 = off)
    metrics_host: str = "127.0.0.1"  # address the exporter binds
    push_hook: str = ""              # "module:function" called on each chunk before it is written (tests' faults)
    inspect_hook: str = ""           # "module:function" shown a request's KV blocks once complete (core/hooks.py)
    helper_cpus: str = "all"         # push/install threads: "all" allowed CPUs, "inherit" the engine pin, or "2-3"
    drain_file: str = ""             # the node's drain state (core/drain.py); "" = one per node in runtime_dir
    runtime_dir: str = ""            # private (0700) directory of the node's shared state files; "" = /dev/shm/kvrelay-<uid>
    sync_landed: bool = True         # decode: a transfer wholly received before its request is scheduled is
                                     # installed inside that step (one step sooner; false: always in the background)
    numa_node: str = "auto"          # the receive pool's and staging buffers' NUMA node: auto (the GPU's, else the
                                     # engine's CPUs'), none (the kernel's first touch), or a node number

    def __post_init__(self) -> None:
        super().__post_init__()
        numa.check_setting(self.numa_node)


class EngineConfig(Section, frozen=True):
    """How `kvrelay up` and the pool launchers start vLLM."""

    model: str = ""                  # HF id or local path; "" = the built-in tiny model
    tiny_model_dir: str = "~/.cache/kvrelay/tiny-model"
    served_model_name: str = ""      # "" = the model path (vLLM's default); the tiny model: kvrelay-tiny
    dtype: str = "auto"              # vLLM --dtype; "auto" = the model's (float32 for the tiny model)
    max_model_len: Positive | None = None   # vLLM --max-model-len; None = vLLM's own (the model's context length)
    prefill_args: list[str] = msgspec.field(default_factory=list)  # extra vLLM args, prefill nodes only
    decode_args: list[str] = msgspec.field(default_factory=list)   # extra vLLM args, decode nodes only
    kv_cache_gib: Positive = 1       # VLLM_CPU_KVCACHE_SPACE on CPU hosts
    cpu_bind: str = "split"          # CPU hosts: "split" the cores among the servers, "vllm" = vLLM's
                                     # default, or a VLLM_CPU_OMP_THREADS_BIND value used for every server
    extra_args: list[str] = msgspec.field(default_factory=list)   # appended to every vLLM command line
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE   # vLLM's kv_load_failure_policy (decode)
    drain_timeout_s: Seconds = 120.0  # SIGTERM: the longest a node drains before it stops anyway
    drain_quiet_s: Seconds = 5.0      # SIGTERM: a node stops once it has been idle this long
    mq_busy_loop_s: float = 0.002     # vLLM's engine<->worker queue: busy-wait this long, then park
                                      # (-1 = vLLM's own 1 s; see core/vllm_plugin.py)

    prefill_tp: Positive = 1          # tensor-parallel size of every prefill engine
    decode_tp: Positive = 1           # tensor-parallel size of every decode engine (may differ from prefill_tp)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("extra_args", "prefill_args", "decode_args"):
            if (flag := parallel_flag(getattr(self, key))) is None:
                continue
            if flag.startswith(TP_FLAGS):
                raise ConfigError(f"engine.{key}: {flag}: set the tensor-parallel size with engine.prefill_tp and "
                                  "engine.decode_tp instead (the connectors on both sides need to know it)")
            raise ConfigError(f"engine.{key}: {flag}: pipeline and data parallelism are not supported; use "
                              "engine.prefill_tp / engine.decode_tp, and scale with more prefill and decode nodes")


class DeployConfig(Section, frozen=True):
    """`kvrelay up`: a local stack of N prefill + M decode servers and a router."""

    prefill: Positive = 1
    decode: Positive = 1
    host: str = "127.0.0.1"
    base_port: Port = 8100           # vLLM servers listen on base_port, base_port+1, ...
    kv_base_port: Port = 9100        # decode node i's transfer control port (+100 for tcp data)
    log_dir: str = "kvrelay-logs"
    startup_timeout_s: Seconds = 600.0
    devices: str = "auto"            # kvrelay serve's GPUs: "auto" (by index and TP), "none", or a list "4,5,6,7"
    device_offset: NonNeg = 0        # auto: the first visible device this role's nodes take


class TracingConfig(Section, frozen=True):
    """OpenTelemetry tracing (core/tracing.py): off while ``endpoint`` is empty."""

    endpoint: str = ""               # OTLP traces endpoint, e.g. http://otel-collector:4318/v1/traces
    protocol: TraceProtocol = TraceProtocol.HTTP


class KVRelayConfig(Section, frozen=True):
    """The root of the tree."""

    chunk_tokens: Positive = 256
    log_format: LogFormat = LogFormat.TEXT
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    deploy: DeployConfig = msgspec.field(default_factory=DeployConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        block = engine_block_size(self.engine)
        if self.chunk_tokens % block:
            raise ConfigError(f"chunk_tokens {self.chunk_tokens} is not a multiple of the engines' block size {block} "
                              "(--block-size, 16 unless set): a chunk is whole blocks, e.g. 256")
        if max(self.engine.prefill_tp, self.engine.decode_tp) > 1 and self.connector.metrics_port:
            raise ConfigError("connector.metrics_port with tensor parallelism: every rank would open the same "
                              "exporter port; read the kvrelay series from the engine's own /metrics (they sum "
                              "the ranks) and set connector.metrics_port: 0")


TINY_NAME = "kvrelay-tiny"       # what the built-in tiny model is served as


def served_name(cfg: KVRelayConfig) -> str:
    """The model name the engines serve (vLLM's ``model_name`` label): ``engine.served_model_name``,
    else the model, else the tiny model's."""
    return cfg.engine.served_model_name or cfg.engine.model or TINY_NAME


def engine_block_size(engine: EngineConfig) -> int:
    """The KV block size the engines' flags set (``--block-size N``), else vLLM's default of 16."""
    given = []
    for args in (engine.extra_args, engine.prefill_args, engine.decode_args):
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == "--block-size" and i + 1 < len(args) else \
                arg.partition("=")[2] if arg.startswith("--block-size=") else ""
            if value.isdigit():
                given.append(int(value))
    return max(given, default=16)


@functools.cache
def _schema() -> Any:
    return msgspec.inspect.type_info(KVRelayConfig)


def _as_text(data: Any, info: Any, name: str = "") -> Any:
    """Scalars YAML reads as numbers or booleans, given where the field is text, become that
    text (``--connector.helper_cpus 3``, ``--engine.prefill_args '[--max-num-seqs, 8]'``); a
    plain string where a list belongs becomes a list: split like a shell line for the engine
    flag lists (``--engine.decode_args "--max-num-seqs 8"``), at commas for the others
    (``--router.prefill http://a:8100,http://b:8100``)."""
    mi = msgspec.inspect
    if data == "auto" and _auto_bool(info):                 # a switch left to the deployment (None)
        return None
    if isinstance(info, mi.StrType) and isinstance(data, bool | int | float):
        return str(data).lower() if isinstance(data, bool) else str(data)
    if isinstance(info, mi.ListType) and isinstance(data, str):
        data = shlex.split(data) if name.endswith("_args") else [v.strip() for v in data.split(",") if v.strip()]
    if isinstance(info, mi.ListType) and isinstance(data, list):
        return [_as_text(v, info.item_type) for v in data]
    if isinstance(info, mi.StructType) and isinstance(data, Mapping):
        fields = {f.name: f.type for f in info.fields}
        return {k: _as_text(v, fields[k], k) if k in fields else v for k, v in data.items()}
    return data


def _auto_bool(info: Any) -> bool:
    """``bool | None``: true, false, or auto (None: decided where the deployment is known)."""
    mi = msgspec.inspect
    return isinstance(info, mi.UnionType) and {type(t) for t in info.types} == {mi.BoolType, mi.NoneType}


def _leaf_info(key: str) -> Any:
    """The type info of the field at ``key`` (``router.decode_first``); None if there is none."""
    info = _schema()
    for part in key.split("."):
        info = {f.name: f.type for f in getattr(info, "fields", ())}.get(part)
    return info


def _enum_values(path: str) -> str:
    """For a validation error at ``path`` (``transport.backend``) on an enum field: its values."""
    info = _leaf_info(path)
    if isinstance(info, msgspec.inspect.EnumType):
        return "; valid values: " + ", ".join(str(m.value) for m in info.cls)
    return ""


def _did_you_mean(name: str, section: str) -> str:
    """For an unknown key ``name`` in ``section`` ("" = top level): "; did you mean `x`?" or ""."""
    info = _schema()
    for part in filter(None, section.split(".")):
        info = {f.name: f.type for f in getattr(info, "fields", ())}.get(part)
    names = [f.name for f in getattr(info, "fields", ())]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close and not section:                    # a leaf given at the top level: which section has it?
        close = [k for k, _ in leaf_fields() if k.endswith(f".{name}")][:1]
    return f"; did you mean `{close[0]}`?" if close else ""


def _convert(data: Mapping[str, Any]) -> KVRelayConfig:
    try:
        return msgspec.convert(_as_text(dict(data), _schema()), KVRelayConfig, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc).replace("`$.", "`").replace("`$`", "`<root>`")
        if (leaf := re.fullmatch(r"(\w+): (.*) - at `([\w.]+)`", msg)) is not None:    # a field's own check
            msg = f"{leaf.group(2)} - at `{leaf.group(3)}.{leaf.group(1)}`"
        if (where := re.search(r"at `([\w.]+)`", msg)) is not None:
            msg += _enum_values(where.group(1))
        if (unknown := re.search(r"unknown field `(\w+)`(?: - at `([\w.]+)`)?", msg)) is not None:
            msg += _did_you_mean(unknown.group(1), unknown.group(2) or "")
        if "shared_secret" in msg:
            msg += ("; the secret no longer lives in the config (it would reach command lines and logs): "
                    "set KVRELAY_SECRET or transport.secret_file")
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
    return from_dict(with_overrides(read_yaml(path) if path is not None else {}, overrides))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's plain data (a mapping; an empty file is ``{}``)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"invalid config {path}: top level must be a mapping")
    return loaded or {}


def with_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``key.sub=value`` override set (the value read as YAML); in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw else "")
    return data


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
    **tcfg.FIELD_HELP,
    **scfg.FIELD_HELP,
    'chunk_tokens': 'tokens per pushed chunk; a multiple of the engine block size',
    'connector.first_chunk_s': "decode: wait this long for a transfer's first chunk, then recompute",
    'connector.free_deadline_s': 'prefill: blocks held for a push are freed after this anyway (counted)',
    'connector.events_path': 'JSONL log of per-chunk and per-request transfer events ("" = off; kvrelay up: log_dir/events.jsonl)',
    'connector.metrics_port': 'Prometheus exporter of each worker (node i: port + i; 0 = off)',
    'connector.metrics_host': 'address the connector metrics exporter binds (loopback unless you open it: 0.0.0.0)',
    'connector.push_hook': ('"module:function" the push thread calls with each chunk before writing it, e.g. a '
                            "test's fault injection (\"\" = none)"),
    'connector.helper_cpus': "push/install threads' CPUs: all (any CPU the container allows), inherit (the engine thread's pin) or a list like 2-3",
    'connector.sync_landed': "decode: a transfer wholly received before vLLM schedules its request (token 1 from P) is "
                             "installed inside that step, before its forward, instead of in the background: token 2 "
                             "comes one engine step sooner. false: always in the background",
    'engine.model': 'HF model id or local path ("" = the built-in tiny model)',
    'engine.tiny_model_dir': 'where the tiny model is created on first use',
    'engine.served_model_name': 'model name clients use ("" = the model path; kvrelay-tiny for the tiny model)',
    'engine.dtype': 'vLLM --dtype (auto; the tiny model runs in float32)',
    'engine.max_model_len': "vLLM --max-model-len (unset: vLLM's own, from the model's config)",
    'engine.prefill_args': 'extra vLLM arguments for prefill nodes only (YAML list)',
    'engine.decode_args': 'extra vLLM arguments for decode nodes only (YAML list)',
    'engine.kv_cache_gib': 'CPU hosts: KV cache size per server in GiB (VLLM_CPU_KVCACHE_SPACE)',
    'engine.cpu_bind': 'CPU hosts: split the cores among the servers, vllm (its default), or a VLLM_CPU_OMP_THREADS_BIND value',
    'engine.load_failure_policy': "decode: vLLM's kv_load_failure_policy: recompute a failed chunk's tokens, or fail",
    'engine.extra_args': 'extra vLLM arguments for every server (YAML list)',
    'engine.mq_busy_loop_s': ("seconds vLLM's engine core and worker busy-wait on their message queue after each "
                              "message before they sleep (vLLM: 1 s; -1 keeps vLLM's)"),
    **rcfg.FIELD_HELP,
    'engine.prefill_tp': "tensor-parallel size of each prefill engine (CPU: a core set per rank; GPU: devices per node)",
    'engine.decode_tp': "tensor-parallel size of each decode engine; may differ from prefill_tp (heads re-sharded)",
    'connector.inspect_hook': "'module:function' shown each request's complete prompt KV per rank (core/hooks.py)",
    'deploy.prefill': 'kvrelay up: number of prefill servers',
    'deploy.decode': 'kvrelay up: number of decode servers',
    'deploy.host': 'kvrelay up: address every server binds to',
    'deploy.base_port': 'kvrelay up: first vLLM HTTP port (prefill nodes first, then decode)',
    'deploy.kv_base_port': 'kvrelay up: decode node i receives chunks on kv_base_port + i (tcp data + 100)',
    'deploy.log_dir': 'kvrelay up: server logs and events.jsonl',
    'connector.numa_node': "NUMA node of the pinned receive pool and the staging buffers: auto (the GPU's node "
                           "from sysfs, else the node of the engine's CPUs; nothing on a one-node host), none, or N",
    'deploy.startup_timeout_s': 'kvrelay up: how long servers may take to become healthy',
    'deploy.devices': "kvrelay serve's GPUs (CUDA_VISIBLE_DEVICES): auto = the index-th group of TP devices from "
                      "device_offset among the visible ones; none = leave the environment; or a list such as 4,5,6,7",
    'deploy.device_offset': 'kvrelay serve, devices auto: the first visible device this role takes (a prefill '
                            'and a decode pool on one host: e.g. 0 and 4)',
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and one ``--section.field`` flag per leaf to ``parser`` (also
    kebab-case; list keys may repeat). Abbreviated flags are refused: ``--transport.pool_byte``
    must not quietly mean ``--transport.pool_bytes``."""
    parser.allow_abbrev = False
    parser.usage = "%(prog)s [options]"          # the flags are listed below, one per key
    group = parser.add_argument_group("configuration (YAML keys; flags override the file)")
    group.add_argument("--config", metavar="FILE", help="deployment YAML")
    for key, default in leaf_fields():
        shown = default.value if isinstance(default, enum.Enum) else "auto" if _auto_bool(_leaf_info(key)) else default
        kebab = key.replace("_", "-")               # vLLM's own flags are kebab-case, as --help shows them
        more: dict[str, Any] = {"action": "append"} if isinstance(default, list) else {}
        group.add_argument(f"--{kebab}", dest=f"cfg:{key}", metavar=_metavar(key, default), default=None, **more,
                           help=f"{FIELD_HELP.get(key, '')} (default: {shown})".strip())
        if kebab != key:                            # the YAML spelling works too, unlisted
            parser.add_argument(f"--{key}", dest=f"cfg:{key}", default=None, help=argparse.SUPPRESS, **more)


def _metavar(key: str, default: Any) -> str:
    """What a flag takes, as ``--help`` shows it."""
    if isinstance(default, bool):
        return "{true,false}"
    if _auto_bool(_leaf_info(key)):
        return "{auto,true,false}"
    if isinstance(default, enum.Enum):
        return "{" + ",".join(str(m.value) for m in type(default)) + "}"
    if key.endswith(("_bytes", ".size")):
        return "SIZE"
    if key.endswith("_s") and isinstance(default, int | float):
        return "SECONDS"
    if key.endswith("port") and isinstance(default, int):
        return "PORT"
    if isinstance(default, int | float) or default is None and key.endswith("_len"):
        return "N"
    return "ARG" if isinstance(default, list) else "TEXT"


def _flag_value(key: str, value: Any) -> Any:
    """A repeated list flag's values as one override: a shell line for the engine argument
    lists, comma-separated for the others (a single value passes as given, YAML included)."""
    if not isinstance(value, list):
        return value
    if len(value) == 1:
        return value[0]
    return " ".join(value) if key.endswith("_args") else ",".join(value)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The ``key.sub=value`` overrides of the config flags given on the command line (of
    :func:`add_config_args`; a flag left out gives none)."""
    return [f"{k[4:]}={_flag_value(k[4:], v)}" for k, v in vars(args).items() if k.startswith("cfg:") and v is not None]


def config_from_args(args: argparse.Namespace) -> KVRelayConfig:
    """Defaults < ``--config`` YAML < flags; then a positional MODEL (``engine.model``) and the vLLM
    arguments given after ``--`` (appended to ``engine.extra_args``)."""
    overrides = flag_overrides(args)
    if getattr(args, "model_arg", None):
        overrides.append(f"engine.model={args.model_arg}")
    cfg = load(getattr(args, "config", None), overrides)
    if tail := getattr(args, "vllm_args", None):
        cfg = load(getattr(args, "config", None),
                   [*overrides, f"engine.extra_args={shlex.join([*cfg.engine.extra_args, *tail])}"])
    return cfg


def to_dict(cfg: KVRelayConfig) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(cfg)
    return data


SECRET_FIELDS = {"router": ("api_keys", "api_keys_file", "tls_cert", "tls_key")}


def engine_view(cfg: KVRelayConfig) -> dict[str, Any]:
    """The tree an engine's connector is given on vLLM's command line (``--kv-transfer-config``),
    where anyone who can run ``ps`` reads it: no client API keys or router TLS files, no deploy
    section, and of the router only ``router.decode`` (:func:`push_allowlist` reads it). The shared
    secret and the Redis password never appear in any tree (files or the environment)."""
    data = to_dict(cfg)
    data.pop("deploy", None)
    data["router"] = {"decode": data["router"]["decode"]}
    return data


def without_secrets(cfg: KVRelayConfig) -> dict[str, Any]:
    """``cfg`` as a dict with every client-facing secret field (:data:`SECRET_FIELDS`) at its default."""
    data = to_dict(cfg)
    defaults = to_dict(KVRelayConfig())
    for section, fields in SECRET_FIELDS.items():
        for f in fields:
            data[section][f] = defaults[section][f]
    return data


def push_allowlist(cfg: KVRelayConfig) -> list[str] | None:
    """The decode endpoints a prefill node may push to: ``transport.allowed_decode``, else the
    transfer endpoints ``router.decode`` names; None (any signed target) if neither names one."""
    named = list(cfg.transport.allowed_decode) or [d.split("=", 1)[1] for d in cfg.router.decode if "=" in d]
    return named or None


CONNECTOR_KEY = "kvrelay"   # kv_connector_extra_config = {"kvrelay": <config tree>}


def from_connector_extra(extra: Mapping[str, Any] | None) -> KVRelayConfig:
    """The tree carried in a vLLM ``kv_connector_extra_config`` (``{"kvrelay": {...}}``)."""
    extra = extra or {}
    unknown = set(extra) - {CONNECTOR_KEY}
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; "
                          f"put the kvrelay config tree under {CONNECTOR_KEY!r}")
    return from_dict(extra.get(CONNECTOR_KEY))
