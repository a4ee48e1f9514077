"""The pods of ``kvrelay deploy k8s``: engine and router Deployments, Services, budgets, policies.

Builders of plain Kubernetes objects (dicts), one per function; :mod:`kvrelay.deploy.k8s`
decides which to render from the config tree and the flags (:class:`K8sOptions`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvrelay import __version__
from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg

PART_OF = "kvrelay"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
QUANTITY = re.compile(r"\d+(\.\d+)?m?")
USER = 1000                # engine and router containers run as this user, never root
CONFIG_DIR, SECRET_DIR, MODEL_DIR = "/etc/kvrelay/config", "/etc/kvrelay/secret", "/models"
HTTP_PORT = 8100          # every engine pod serves vLLM on this port
KV_PORT = 9100            # decode pods: transfer control port (tcp data on KV_PORT + 100)
KV_DATA_PORT = KV_PORT + 100
AUTO_POOL_ESTIMATE = 4 << 30     # transport.pool_bytes 0 (sized from the model at start): counted as 4 GiB
CHECKSUM = "kvrelay.io/config-sha256"


@dataclass(frozen=True)
class K8sOptions:
    """What the cluster decides and the config tree does not (the flags of ``kvrelay deploy k8s``)."""

    namespace: str = "kvrelay"
    release: str = "kvrelay"          # prefixes every object's name; two releases share a namespace
    existing_secret: str = ""         # a Secret made outside (keys: secret, api_keys): none is rendered
    image: str = f"kvrelay:{__version__}"
    prefill_gpus: int | None = None   # GPUs per prefill pod; None: engine.prefill_tp (1 unless set)
    decode_gpus: int | None = None
    engine_cpus: str = "8"
    engine_memory: str = "32Gi"
    router_replicas: int = 2
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()
    rdma_resource: str = ""
    ucx_net_devices: str = ""
    model_cache_pvc: str = ""
    hf_token_secret: str = "hf-token"
    metrics_namespace: str = "monitoring"
    metrics_pods: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "prometheus"})
    redis: bool = False

    def __post_init__(self) -> None:
        for flag, value, longest in (("--namespace", self.namespace, 63), ("--release", self.release, 40),
                                     ("--metrics-namespace", self.metrics_namespace, 63)):
            if not DNS_LABEL.fullmatch(value) or len(value) > longest:
                raise ConfigError(f"{flag} {value!r}: lower-case letters, digits and '-', starting and ending with "
                                  f"a letter or digit, at most {longest} characters")
        if self.existing_secret and not DNS_NAME.fullmatch(self.existing_secret):
            raise ConfigError(f"--existing-secret {self.existing_secret!r} is not a valid Secret name")
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image {self.image!r}: an image reference such as registry/kvrelay:0.1.0")
        if not QUANTITY.fullmatch(self.engine_cpus) or self.engine_cpus in ("0", "0m"):
            raise ConfigError(f"--engine-cpus {self.engine_cpus!r}: a CPU quantity such as 8 or 7500m")
        for flag, n in (("--prefill-gpus", self.prefill_gpus), ("--decode-gpus", self.decode_gpus)):
            if n is not None and n < 0:
                raise ConfigError(f"{flag} must be at least 0 (0: CPU pods), got {n}")
        if self.router_replicas < 1:
            raise ConfigError(f"--router-replicas must be at least 1, got {self.router_replicas}")

    def name(self, part: str) -> str:
        """An object's name: the release, then what it is."""
        return f"{self.release}-{part}"

    @property
    def secret(self) -> str:
        return self.existing_secret or self.name("secret")

    def labels(self, component: str) -> dict[str, str]:
        return labels(component, self.release)

    def meta(self, part: str, component: str) -> dict[str, Any]:
        return {"name": self.name(part), "namespace": self.namespace, "labels": self.labels(component)}


def labels(component: str, release: str = "kvrelay") -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/instance": release,
            "app.kubernetes.io/component": component}


@dataclass(frozen=True)
class EnginePod:
    """One engine pod's shape: its role, devices and the resources it requests."""

    role: str
    gpus: int
    tp: int                  # tensor-parallel ranks (= gpus on GPU pods); decode rank r listens on each port + r
    cpus: str
    memory_bytes: int
    drain_timeout_s: float


def _probe(role: str, kind: str) -> dict[str, Any]:
    cmd = ["kvrelay", "probe", "--port", str(HTTP_PORT)] + (["--kv-port", str(KV_PORT)] if role == "decode" else [])
    cmd += ["--liveness"] if kind == "liveness" else []     # a draining node is alive (deploy/supervisor.py)
    timing = {"startup": {"periodSeconds": 10, "failureThreshold": 90},      # model load: up to 15 min
              "readiness": {"periodSeconds": 5, "failureThreshold": 2},
              "liveness": {"periodSeconds": 15, "failureThreshold": 4}}[kind]
    return {"exec": {"command": cmd}, "timeoutSeconds": 5, **timing}


def _volumes(opts: K8sOptions, engine: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    vols: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": opts.name("config")}},
                                  {"name": "secret", "secret": {"secretName": opts.secret, "defaultMode": 0o440}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}]
    if engine:
        cache = ({"persistentVolumeClaim": {"claimName": opts.model_cache_pvc}} if opts.model_cache_pvc
                 else {"emptyDir": {}})
        vols += [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "model-cache", **cache}]
        mounts += [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "model-cache", "mountPath": MODEL_DIR}]
    return vols, mounts


def _engine_env(opts: K8sOptions) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HF_HOME", "value": f"{MODEL_DIR}/huggingface"},
        {"name": "HOME", "value": f"{MODEL_DIR}/home"}]      # caches of a non-root user (kvrelay's digests, vLLM's)
    if opts.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": opts.hf_token_secret, "key": "token",
                                                                        "optional": True}}})
    if opts.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": opts.ucx_net_devices})
    return env


def _resources(pod: EnginePod, opts: K8sOptions) -> dict[str, Any]:
    memory = f"{math.ceil(pod.memory_bytes / (1 << 20))}Mi"     # the pinned pool is committed: request = limit
    requests: dict[str, Any] = {"cpu": pod.cpus, "memory": memory}
    limits: dict[str, Any] = {"memory": memory}
    for extra in (("nvidia.com/gpu", pod.gpus),) + (((opts.rdma_resource, 1),) if opts.rdma_resource else ()):
        if extra[1]:
            requests[extra[0]] = limits[extra[0]] = extra[1]
    return {"requests": requests, "limits": limits}


def engine_deployment(pod: EnginePod, replicas: int | None, opts: K8sOptions, checksum: str) -> dict[str, Any]:
    """A pool's Deployment; ``replicas`` None leaves the count to an autoscaler (a re-apply never resets it)."""
    role = pod.role
    args = ["serve", "--role", role, "--config", f"{CONFIG_DIR}/kvrelay.yaml", "--port", str(HTTP_PORT)]
    ports = [{"name": "http", "containerPort": HTTP_PORT}]
    if role == "decode":
        args += ["--transport.advertise_host", "$(POD_IP)"]
        for r in range(pod.tp):
            suffix = f"-{r}" if r else ""
            ports += [{"name": f"kv{suffix}", "containerPort": KV_PORT + r},
                      {"name": f"kv-data{suffix}", "containerPort": KV_DATA_PORT + r}]
    vols, mounts = _volumes(opts, engine=True)
    container: dict[str, Any] = {
        "name": role, "image": opts.image, "command": ["kvrelay"], "args": args, "ports": ports,
        "env": _engine_env(opts), "resources": _resources(pod, opts),
        "startupProbe": _probe(role, "startup"), "readinessProbe": _probe(role, "readiness"),
        "livenessProbe": _probe(role, "liveness"), "volumeMounts": mounts}
    # registering pinned memory (the receive pool) with a NIC or the GPU needs IPC_LOCK; nothing else is kept
    container["securityContext"] = container_security(("IPC_LOCK",) if opts.rdma_resource or pod.gpus else ())
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": math.ceil(pod.drain_timeout_s) + 45,   # drain, then stop
                            "serviceAccountName": opts.name("engine"), "automountServiceAccountToken": False,
                            "securityContext": POD_SECURITY, "containers": [container], "volumes": vols}
    if opts.node_selector:
        spec["nodeSelector"] = dict(opts.node_selector)
    if opts.tolerations:
        spec["tolerations"] = [dict(t) for t in opts.tolerations]
    # a GPU pool replaces a pod in place: a surge pod would wait for GPUs a full cluster does not have
    rolling = {"maxUnavailable": 1, "maxSurge": 0} if pod.gpus else {"maxUnavailable": 0, "maxSurge": 1}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": opts.meta(role, role),
            "spec": {**({"replicas": replicas} if replicas is not None else {}),
                     "selector": {"matchLabels": opts.labels(role)},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
                     "template": {"metadata": {"labels": opts.labels(role), "annotations": {CHECKSUM: checksum}},
                                  "spec": spec}}}


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER, "fsGroup": USER,
                "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(add: tuple[str, ...] = ()) -> dict[str, Any]:
    """No privilege escalation, every capability dropped but ``add``."""
    caps: dict[str, Any] = {"drop": ["ALL"], **({"add": list(add)} if add else {})}
    return {"allowPrivilegeEscalation": False, "capabilities": caps}


def service_account(opts: K8sOptions, component: str) -> dict[str, Any]:
    """A service account of its own, with no API token mounted (no pod talks to the API server)."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": opts.meta(component, component),
            "automountServiceAccountToken": False}


def headless_service(role: str, opts: K8sOptions) -> dict[str, Any]:
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}]
    if role == "decode":
        ports.append({"name": "kv", "port": KV_PORT, "targetPort": "kv"})
    spec: dict[str, Any] = {"clusterIP": "None", "selector": opts.labels(role), "ports": ports}
    if role == "decode":
        # a draining decode pod is not ready but still finishes its streams: prefill pods keep it in
        # their push allowlist (router.decode resolves through this Service); the router health-checks
        # every address itself, so a starting pod gets no traffic
        spec["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service", "metadata": opts.meta(role, role), "spec": spec}


def disruption_budget(component: str, opts: K8sOptions, rule: dict[str, int]) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": opts.meta(component, component),
            "spec": {**rule, "selector": {"matchLabels": opts.labels(component)}}}


def router_objects(port: int, opts: K8sOptions, checksum: str) -> list[dict[str, Any]]:
    vols, mounts = _volumes(opts, engine=False)
    http = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    container = {"name": "router", "image": opts.image, "command": ["kvrelay"],
                 "args": ["router", "--config", f"{CONFIG_DIR}/kvrelay.yaml"],
                 "ports": [{"name": "http", "containerPort": port}],
                 "readinessProbe": http, "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10},
                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                 "securityContext": container_security(), "volumeMounts": mounts}
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": opts.labels("router")},
                                            "topologyKey": "kubernetes.io/hostname"}}]}}
    pod = {"affinity": spread, "serviceAccountName": opts.name("router"), "automountServiceAccountToken": False,
           "securityContext": POD_SECURITY, "containers": [container], "volumes": vols}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": opts.meta("router", "router"),
           "spec": {"replicas": opts.router_replicas, "selector": {"matchLabels": opts.labels("router")},
                    "template": {"metadata": {"labels": opts.labels("router"), "annotations": {CHECKSUM: checksum}},
                                 "spec": pod}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": opts.meta("router", "router"),
           "spec": {"selector": opts.labels("router"), "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}
    budget = disruption_budget("router", opts, {"minAvailable": 1})
    return [service_account(opts, "router"), dep, svc] + ([budget] if opts.router_replicas > 1 else [])


def redis_objects(opts: K8sOptions) -> list[dict[str, Any]]:
    container = {"name": "redis", "image": "redis:7", "ports": [{"name": "redis", "containerPort": 6379}],
                 "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
                 "securityContext": container_security()}
    pod = {"automountServiceAccountToken": False, "securityContext": {**POD_SECURITY, "runAsUser": 999, "runAsGroup": 999,
                                                                       "fsGroup": 999},      # the redis image's user
           "containers": [container]}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": opts.meta("redis", "redis"),
           "spec": {"replicas": 1, "selector": {"matchLabels": opts.labels("redis")},
                    "template": {"metadata": {"labels": opts.labels("redis")}, "spec": pod}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": opts.meta("redis", "redis"),
           "spec": {"selector": opts.labels("redis"), "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]}}
    return [dep, svc]


def _from_stack(opts: K8sOptions) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF,
                                            "app.kubernetes.io/instance": opts.release}}}


def _policy(opts: K8sOptions, component: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": opts.meta(component, component),
            "spec": {"podSelector": {"matchLabels": opts.labels(component)}, "policyTypes": ["Ingress"], "ingress": rules}}


def network_policies(cfg: kcfg.KVRelayConfig, opts: K8sOptions, events_port: int) -> list[dict[str, Any]]:
    """Ingress rules: the data plane (transfer control and data, store events, Redis) reaches only
    the stack's own pods; an engine's HTTP port - vLLM's unauthenticated OpenAI API as well as its
    /metrics - the routers and the Prometheus pods (``metrics_pods`` in ``metrics_namespace``)
    alone; the router's port is open (clients authenticate with API keys)."""
    scrape = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": opts.metrics_namespace}},
              "podSelector": {"matchLabels": dict(opts.metrics_pods)}}
    routers_only = {"podSelector": {"matchLabels": opts.labels("router")}}
    http = {"from": [routers_only, scrape], "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}
    ranks = cfg.engine.decode_tp                 # decode rank r: KV_PORT + r and KV_DATA_PORT + r
    decode = {"from": [_from_stack(opts)], "ports": [{"protocol": "TCP", "port": base + r} for base in (KV_PORT, KV_DATA_PORT)
                                                 for r in range(ranks)]}
    prefill: list[dict[str, Any]] = [http]
    decode_rules: list[dict[str, Any]] = [http, decode]
    if cfg.store.publish_port:
        prefill.append({"from": [_from_stack(opts)], "ports": [{"protocol": "TCP", "port": events_port}]})
    if cfg.router.kv_events_port:               # the KV events carry prompt token ids: the routers alone
        routers = {"from": [routers_only],
                   "ports": [{"protocol": "TCP", "port": cfg.router.kv_events_port}]}
        prefill.append(routers)
        decode_rules.append(routers)
    objs = [_policy(opts, "prefill", prefill), _policy(opts, "decode", decode_rules),
            _policy(opts, "router", [{"ports": [{"protocol": "TCP", "port": cfg.router.port}]}])]
    if opts.redis and cfg.store.enabled:
        objs.append(_policy(opts, "redis", [{"from": [_from_stack(opts)], "ports": [{"protocol": "TCP", "port": 6379}]}]))
    return objs
