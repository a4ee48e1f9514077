"""`kvrelay deploy k8s`: Kubernetes manifests rendered from the kvrelay config tree.

One source of truth: the same YAML that ``kvrelay up`` and the pool scripts read goes
into a ConfigMap, and every pod runs ``kvrelay serve`` / ``kvrelay router`` on it, with
only the per-pod settings as flags (bind ``0.0.0.0``, announce the pod IP). Rendered:

* ``kvrelay-prefill`` / ``kvrelay-decode``: Deployments (``deploy.prefill`` / ``deploy.decode``
  replicas, ``--gpus-per-pod`` GPUs each, tensor parallel across them), each behind a
  headless Service the router resolves (``dns+http://...``, re-resolved every
  ``router.dns_refresh_s``); probes run ``kvrelay probe``: the engine's ``/health`` *and*,
  on decode pods, the transfer endpoint;
* ``kvrelay-router``: Deployment + Service (port ``router.port``);
* ``kvrelay-redis``: Deployment + Service when ``store.enabled`` and ``--redis``;
* ``kvrelay-config`` (ConfigMap) and ``kvrelay-secret`` (Secret, a new shared secret unless
  ``--secret-file``; the file is written mode 0600);
* PodDisruptionBudgets for both pools (one pod at a time) and a PodMonitor
  (``monitoring.coreos.com/v1``, prometheus-operator) scraping every pod's ``/metrics``.

The manifests do not start anything; ``tests/test_k8s.py`` validates them offline with
``kubernetes-validate`` (strict) against a current Kubernetes release.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import yaml
from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import generate_secret
from kvrelay.core import config as kcfg

PART_OF = "kvrelay"
CONFIG_DIR, SECRET_DIR = "/etc/kvrelay/config", "/etc/kvrelay/secret"
API_KEYS = "api_keys"          # the Secret's key (and file under SECRET_DIR) of the router's client API keys
HTTP_PORT = 8100          # every engine pod serves vLLM on this port
KV_PORT = 9100            # decode pods: transfer control port (tcp data on KV_PORT + 100)
EVENTS_PORT = 9400        # prefill pods (store on, cache_aware): store events for the router
K8S_VERSION = "1.33.0"    # what the tests validate against


def add_args(p: argparse.ArgumentParser) -> None:
    kcfg.add_config_args(p)
    p.add_argument("--out", required=True, help="directory for the manifests (one file per object)")
    p.add_argument("--namespace", default="kvrelay")
    p.add_argument("--image", default="ghcr.io/example/kvrelay:latest",
                   help="an image with kvrelay and vllm installed (kvrelay on PATH)")
    p.add_argument("--gpus-per-pod", type=int, default=1,
                   help="GPUs per engine pod; > 1 runs vLLM with --tensor-parallel-size N")
    p.add_argument("--secret-file", default="", help="use this shared secret instead of generating one")
    p.add_argument("--redis", action="store_true", help="also deploy a Redis for the store's shared tier")


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": component}


def _meta(name: str, ns: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": ns, "labels": _labels(component)}


def cluster_config(cfg: kcfg.KVRelayConfig, ns: str, gpus: int, redis: bool) -> kcfg.KVRelayConfig:
    """The tree every pod reads: pools by DNS, the secret from the mounted Secret."""
    data = kcfg.to_dict(cfg)
    svc = f"{ns}.svc.cluster.local"
    prefill = f"dns+http://kvrelay-prefill.{svc}:{HTTP_PORT}"
    if data["router"]["policy"] == "cache_aware" and data["store"]["enabled"]:
        # the router follows every prefill pod's store events (router/cache_index.py)
        data["store"]["publish_port"] = EVENTS_PORT
        prefill += f"=tcp://kvrelay-prefill.{svc}:{EVENTS_PORT}"
        data["router"]["tokenizer"] = data["router"]["tokenizer"] or data["engine"]["model"]
    elif data["router"]["policy"] == "cache_aware":
        data["router"]["policy"] = "least_outstanding"      # no store, no events to route by
    data["router"].update(host="0.0.0.0", prefill=[prefill],
                          decode=[f"dns+http://kvrelay-decode.{svc}:{HTTP_PORT}=tcp://kvrelay-decode.{svc}:{KV_PORT}"])
    data["transport"].update(secret_file=f"{SECRET_DIR}/secret", host="0.0.0.0", allowed_decode=[])
    data["deploy"].update(host="0.0.0.0", base_port=HTTP_PORT, kv_base_port=KV_PORT)
    data["engine"]["cpu_bind"] = "vllm"
    if gpus > 1 and "--tensor-parallel-size" not in data["engine"]["extra_args"]:
        data["engine"]["extra_args"] = [*data["engine"]["extra_args"], "--tensor-parallel-size", str(gpus)]
    if redis and data["store"]["enabled"]:
        data["store"]["redis_url"] = f"redis://kvrelay-redis.{svc}:6379/0"
    if data["router"]["api_keys"]:              # client keys live in the Secret, never in the ConfigMap
        data["router"].update(api_keys=[], api_keys_file=f"{SECRET_DIR}/{API_KEYS}")
    return kcfg.from_dict(data)


def _probe(role: str, kind: str) -> dict[str, Any]:
    cmd = ["kvrelay", "probe", "--port", str(HTTP_PORT)] + (["--kv-port", str(KV_PORT)] if role == "decode" else [])
    cmd += ["--liveness"] if kind == "liveness" else []     # a draining node is alive (deploy/drain.py)
    timing = {"startup": {"periodSeconds": 10, "failureThreshold": 90},      # model load: up to 15 min
              "readiness": {"periodSeconds": 5, "failureThreshold": 2},
              "liveness": {"periodSeconds": 15, "failureThreshold": 4}}[kind]
    return {"exec": {"command": cmd}, "timeoutSeconds": 5, **timing}


def _volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    vols: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": "kvrelay-config"}},
            {"name": "secret", "secret": {"secretName": "kvrelay-secret", "defaultMode": 0o400}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    return vols, mounts


def engine_deployment(role: str, replicas: int, ns: str, image: str, gpus: int,
                      drain_timeout_s: float = 120.0) -> dict[str, Any]:
    args = ["serve", "--role", role, "--config", f"{CONFIG_DIR}/kvrelay.yaml", "--port", str(HTTP_PORT)]
    ports = [{"name": "http", "containerPort": HTTP_PORT}]
    if role == "decode":
        args += ["--transport.advertise_host", "$(POD_IP)"]
        ports += [{"name": "kv", "containerPort": KV_PORT}, {"name": "kv-data", "containerPort": KV_PORT + 100}]
    vols, mounts = _volumes()
    container = {
        "name": role, "image": image, "command": ["kvrelay"], "args": args, "ports": ports,
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        "startupProbe": _probe(role, "startup"), "readinessProbe": _probe(role, "readiness"),
        "livenessProbe": _probe(role, "liveness"), "volumeMounts": mounts}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(f"kvrelay-{role}", ns, role),
            "spec": {"replicas": replicas, "selector": {"matchLabels": _labels(role)},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": _labels(role)},
                                  # SIGTERM drains for up to drain_timeout_s, then vLLM stops (deploy/drain.py)
                                  "spec": {"terminationGracePeriodSeconds": math.ceil(drain_timeout_s) + 45,
                                           "containers": [container],
                                           "volumes": vols}}}}


def headless_service(role: str, ns: str) -> dict[str, Any]:
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}]
    if role == "decode":
        ports.append({"name": "kv", "port": KV_PORT, "targetPort": "kv"})
    spec: dict[str, Any] = {"clusterIP": "None", "selector": _labels(role), "ports": ports}
    if role == "decode":
        # a draining decode pod is not ready but still finishes its streams: prefill pods keep it in
        # their push allowlist (router.decode resolves through this Service); the router health-checks
        # every address itself, so a starting pod gets no traffic
        spec["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(f"kvrelay-{role}", ns, role), "spec": spec}


def router_objects(cfg: kcfg.KVRelayConfig, ns: str, image: str) -> list[dict[str, Any]]:
    port = cfg.router.port
    vols, mounts = _volumes()
    http = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    container = {"name": "router", "image": image, "command": ["kvrelay"],
                 "args": ["router", "--config", f"{CONFIG_DIR}/kvrelay.yaml"],
                 "ports": [{"name": "http", "containerPort": port}],
                 "readinessProbe": http, "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10},
                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}, "volumeMounts": mounts}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta("kvrelay-router", ns, "router"),
           "spec": {"replicas": 1, "selector": {"matchLabels": _labels("router")},
                    "template": {"metadata": {"labels": _labels("router")},
                                 "spec": {"containers": [container], "volumes": vols}}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": _meta("kvrelay-router", ns, "router"),
           "spec": {"selector": _labels("router"), "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}
    return [dep, svc]


def redis_objects(ns: str) -> list[dict[str, Any]]:
    container = {"name": "redis", "image": "redis:7", "ports": [{"name": "redis", "containerPort": 6379}],
                 "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5}}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta("kvrelay-redis", ns, "redis"),
           "spec": {"replicas": 1, "selector": {"matchLabels": _labels("redis")},
                    "template": {"metadata": {"labels": _labels("redis")}, "spec": {"containers": [container]}}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": _meta("kvrelay-redis", ns, "redis"),
           "spec": {"selector": _labels("redis"), "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]}}
    return [dep, svc]


def render(cfg: kcfg.KVRelayConfig, ns: str, image: str, gpus: int, secret: str,
           redis: bool = False) -> list[dict[str, Any]]:
    """Every object, in apply order."""
    if gpus < 1:
        raise ConfigError(f"--gpus-per-pod must be at least 1 (got {gpus})")
    tree = cluster_config(cfg, ns, gpus, redis)
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("kvrelay-config", ns, "config"),
         "data": {"kvrelay.yaml": yaml.safe_dump(kcfg.to_dict(tree), sort_keys=False)}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta("kvrelay-secret", ns, "config"),
         "type": "Opaque", "stringData": {"secret": secret,
                                          **({API_KEYS: "\n".join(cfg.router.api_keys) + "\n"}
                                             if cfg.router.api_keys else {})}},
    ]
    for role, n in (("prefill", cfg.deploy.prefill), ("decode", cfg.deploy.decode)):
        objs += [headless_service(role, ns), engine_deployment(role, n, ns, image, gpus, cfg.engine.drain_timeout_s),
                 {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(f"kvrelay-{role}", ns, role),
                  "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(role)}}}]
    objs += router_objects(tree, ns, image)
    if redis and cfg.store.enabled:
        objs += redis_objects(ns)
    objs.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                 "metadata": _meta("kvrelay", ns, "metrics"),
                 "spec": {"selector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}},
                          "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}})
    return objs


def write(objs: list[dict[str, Any]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objs):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        if obj["kind"] == "Secret":
            os.chmod(path, 0o600)
        paths.append(path)
    return paths


def main(args: argparse.Namespace) -> int:
    cfg = kcfg.config_from_args(args)
    try:
        secret = Path(args.secret_file).read_text().strip() if args.secret_file else generate_secret()
    except OSError as exc:
        raise ConfigError(f"--secret-file: cannot read {args.secret_file}: {exc.strerror or exc}") from exc
    objs = render(cfg, args.namespace, args.image, args.gpus_per_pod, secret, args.redis)
    paths = write(objs, Path(args.out))
    print(f"kvrelay: wrote {len(paths)} manifests to {args.out} (namespace {args.namespace}); "
          f"apply with: kubectl apply -f {args.out}")
    return 0

