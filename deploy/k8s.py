"""`kvrelay deploy k8s`: Kubernetes manifests rendered from the kvrelay config tree.

One source of truth: the same YAML that ``kvrelay up`` and the pool scripts read goes
into a ConfigMap, and every pod runs ``kvrelay serve`` / ``kvrelay router`` on it, with
only the per-pod settings as flags (bind ``0.0.0.0``, announce the pod IP). Every object's
name starts with ``--release`` (``kvrelay``) and every selector carries it as the
``app.kubernetes.io/instance`` label, so several releases share a namespace. Rendered, in
apply order:

* a Namespace; ``<release>-config`` (ConfigMap) and ``<release>-secret`` (Secret: a new shared
  secret unless ``--secret-file``; the file is written mode 0600), or no Secret at all with
  ``--existing-secret NAME``; a ServiceAccount per role, with no API token mounted;
* ``<release>-prefill`` / ``<release>-decode``: Deployments (``deploy.prefill`` / ``deploy.decode``
  replicas; ``--prefill-gpus`` / ``--decode-gpus`` GPUs each; CPU and memory requests sized
  from ``transport.pool_bytes`` and the store's tiers, since the receive pool is pinned and
  counts against memory from start-up), each behind a headless Service the router resolves
  (``dns+http://...``); probes run ``kvrelay probe``: the engine's ``/health`` *and*, on
  decode pods, the transfer endpoint; a model cache volume and an optional HF token. GPU pods
  roll one at a time in place (``maxSurge: 0``: a full cluster has no GPU for a surge pod);
* ``<release>-router``: a Deployment of ``--router-replicas`` (2) spread over nodes, a Service;
* ``<release>-redis`` when ``store.enabled`` and ``--redis``;
* PodDisruptionBudgets (engine pools: one pod at a time; router: one always up);
* NetworkPolicies: the transfer, control and store-event ports open only to the release's own
  pods, the engines' KV-event port (``router.decode_first``) only to the routers, the engines'
  HTTP port to the routers and to Prometheus's pods in ``--metrics-namespace``;
* a PodMonitor and a PrometheusRule (the alerts of ``deploy/monitoring/alerts.yaml``) for
  the Prometheus Operator;
* on request, a HorizontalPodAutoscaler per engine pool on vLLM's waiting requests
  (``--autoscale-prefill`` / ``--autoscale-decode MIN:MAX``) and a Gateway API HTTPRoute to the
  router (``--gateway``), see :mod:`kvrelay.deploy.k8s_scale`.

Every pod runs as a non-root user with every capability dropped (``IPC_LOCK`` kept where the
pinned pool is registered with a GPU or a NIC) and no privilege escalation. Every pod template
carries the checksum of the ConfigMap and Secret, so changing either rolls the pods. Invalid
names and quantities, and the built-in tiny model on GPU pods, are refused with one line.
Nothing is started; ``tests/deploy/test_k8s.py`` validates the manifests offline with
``kubernetes-validate`` (strict) against Kubernetes 1.31 to 1.34.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvrelay import __version__
from kvrelay.common.config_fields import parse_size
from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import generate_secret
from kvrelay.core import config as kcfg
from kvrelay.deploy import k8s_pods as pods
from kvrelay.deploy import k8s_scale as scaling
from kvrelay.deploy.k8s_pods import HTTP_PORT, KV_PORT, SECRET_DIR, K8sOptions, labels

EVENTS_PORT = 9400        # prefill pods (store on, cache_aware): store events for the router
KV_EVENTS_PORT = 9401     # every engine pod (router.decode_first): vLLM's KV events for the routers
API_KEYS = "api_keys"     # the Secret's key (and file under SECRET_DIR) of the router's client API keys
K8S_VERSIONS = ("1.31.0", "1.32.0", "1.33.0", "1.34.0")    # what the tests validate against
ALERTS = Path(__file__).resolve().parent / "monitoring" / "alerts.yaml"


def add_args(p: argparse.ArgumentParser) -> None:
    kcfg.add_config_args(p)
    p.add_argument("--out", required=True, help="directory for the manifests (one file per object)")
    p.add_argument("--namespace", default="kvrelay", help="namespace of every object (rendered too)")
    p.add_argument("--release", default="kvrelay", help="prefix of every object's name and the instance label of its "
                   "selectors, so several releases share a namespace (default kvrelay)")
    p.add_argument("--existing-secret", default="", metavar="NAME",
                   help="a Secret you manage (keys: secret, and api_keys when router.api_keys is set); no Secret is "
                        "rendered or written")
    p.add_argument("--image", default=K8sOptions.image, help="an image with kvrelay and vLLM installed (kvrelay "
                   f"on PATH); deploy/Dockerfile builds one: docker build -t kvrelay:{__version__} -f deploy/Dockerfile .")
    p.add_argument("--prefill-gpus", type=int, default=None,
                   help="GPUs per prefill pod, which is its engine's tensor-parallel size (default engine.prefill_tp, "
                        "1 unless set; 0: CPU pods)")
    p.add_argument("--decode-gpus", type=int, default=None,
                   help="GPUs per decode pod = its engine's TP size; may differ from --prefill-gpus (default "
                        "engine.decode_tp; 0: CPU pods)")
    p.add_argument("--gpus-per-pod", type=int, default=None, help="both of the above at once")
    p.add_argument("--engine-cpus", default="8", help="CPU request of an engine pod (default 8)")
    p.add_argument("--engine-memory", default="32Gi", help="memory of an engine pod before its receive pool and "
                   "store tiers, which are added (default 32Gi)")
    p.add_argument("--router-replicas", type=int, default=2, help="router pods (default 2, with a disruption budget)")
    p.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="engine pods' nodeSelector entry (repeatable)")
    p.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
                   help="engine pods tolerate this taint (repeatable), e.g. nvidia.com/gpu:NoSchedule")
    p.add_argument("--rdma-resource", default="", metavar="NAME",
                   help="RDMA device plugin resource for engine pods (e.g. rdma/hca_shared_devices_a): one each, "
                   "plus IPC_LOCK for pinned memory registration")
    p.add_argument("--ucx-net-devices", default="", help="UCX_NET_DEVICES for engine pods (e.g. mlx5_0:1)")
    p.add_argument("--model-cache-pvc", default="", help="PersistentVolumeClaim for the model cache "
                   "(default: an emptyDir per pod, downloaded at each start)")
    p.add_argument("--hf-token-secret", default="hf-token", help="Secret whose key 'token' becomes HF_TOKEN "
                   "(optional: pods start without it)")
    p.add_argument("--metrics-namespace", default="monitoring", help="namespace Prometheus scrapes from (the "
                   "NetworkPolicy lets its Prometheus pods reach the engines' port for /metrics)")
    p.add_argument("--metrics-pod-label", action="append", default=[], metavar="KEY=VALUE",
                   help="labels of the Prometheus pods in --metrics-namespace (repeatable; default "
                   "app.kubernetes.io/name=prometheus): with the routers, the only pods that reach an engine's "
                   "HTTP port, which also serves vLLM's unauthenticated API")
    p.add_argument("--secret-file", default="", help="use this shared secret instead of generating one")
    p.add_argument("--redis", action="store_true", help="also deploy a Redis for the store's shared tier")
    scaling.add_args(p)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _toleration(text: str) -> dict[str, str]:
    spec, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ConfigError(f"--toleration {text!r}: expected KEY[=VALUE]:NoSchedule|PreferNoSchedule|NoExecute")
    key, eq, value = spec.partition("=")
    return {"key": key, "operator": "Equal", "value": value, "effect": effect} if eq else \
        {"key": key, "operator": "Exists", "effect": effect}


def options_from_args(args: argparse.Namespace) -> K8sOptions:
    both = args.gpus_per_pod
    return K8sOptions(
        namespace=args.namespace, release=args.release, existing_secret=args.existing_secret, image=args.image,
        prefill_gpus=args.prefill_gpus if args.prefill_gpus is not None else both,
        decode_gpus=args.decode_gpus if args.decode_gpus is not None else both,
        engine_cpus=args.engine_cpus, engine_memory=args.engine_memory, router_replicas=args.router_replicas,
        node_selector=_pairs(args.node_selector, "--node-selector"),
        tolerations=tuple(_toleration(t) for t in args.toleration), rdma_resource=args.rdma_resource,
        ucx_net_devices=args.ucx_net_devices, model_cache_pvc=args.model_cache_pvc,
        hf_token_secret=args.hf_token_secret, metrics_namespace=args.metrics_namespace, redis=args.redis,
        **({"metrics_pods": _pairs(args.metrics_pod_label, "--metrics-pod-label")} if args.metrics_pod_label else {}))


def cluster_config(cfg: kcfg.KVRelayConfig, opts: K8sOptions) -> kcfg.KVRelayConfig:
    """The tree every pod reads: pools by DNS, the secret from the mounted Secret."""
    data = kcfg.to_dict(cfg)
    svc = f"{opts.namespace}.svc.cluster.local"
    prefill_host, decode_host = f"{opts.name('prefill')}.{svc}", f"{opts.name('decode')}.{svc}"
    prefill = f"dns+http://{prefill_host}:{HTTP_PORT}"
    if data["router"]["policy"] == "cache_aware" and data["store"]["enabled"]:
        # the router follows every prefill pod's store events (router/cache_index.py)
        data["store"]["publish_port"] = EVENTS_PORT
        prefill += f"=tcp://{prefill_host}:{EVENTS_PORT}"
        data["router"]["tokenizer"] = data["router"]["tokenizer"] or data["engine"]["model"]
    elif data["router"]["policy"] == "cache_aware":
        data["router"]["policy"] = "least_outstanding"      # no store, no events to route by
    if data["router"]["decode_first"] is not False:     # true, or auto (the default)
        # every engine pod publishes its KV events on its own port; each router subscribes to the pods it resolves
        data["router"].update(kv_events=[], kv_events_port=KV_EVENTS_PORT,
                              tokenizer=data["router"]["tokenizer"] or data["engine"]["model"])
    data["router"].update(host="0.0.0.0", prefill=[prefill],
                          decode=[f"dns+http://{decode_host}:{HTTP_PORT}=tcp://{decode_host}:{KV_PORT}"])
    data["transport"].update(secret_file=f"{SECRET_DIR}/secret", host="0.0.0.0", allowed_decode=[])
    data["deploy"].update(host="0.0.0.0", base_port=HTTP_PORT, kv_base_port=KV_PORT)
    data["engine"]["cpu_bind"] = "vllm"
    if opts.redis and data["store"]["enabled"]:
        data["store"]["redis_url"] = f"redis://{opts.name('redis')}.{svc}:6379/0"
    if data["router"]["api_keys"]:              # client keys live in the Secret, never in the ConfigMap
        data["router"].update(api_keys=[], api_keys_file=f"{SECRET_DIR}/{API_KEYS}")
    return kcfg.from_dict(data)


def with_gpus(cfg: kcfg.KVRelayConfig, opts: K8sOptions) -> tuple[kcfg.KVRelayConfig, dict[str, int]]:
    """Each role's GPUs per pod and the tree with each engine's TP derived from them: a GPU pod's
    GPUs are its engine's ranks. Unset flags take the GPUs from ``engine.prefill_tp`` /
    ``engine.decode_tp``; a flag that contradicts a TP set in the YAML is an error, as is TP > 1
    on a CPU pod's default binding."""
    gpus, tps = {}, {}
    for role, flag, given in (("prefill", "--prefill-gpus", opts.prefill_gpus),
                              ("decode", "--decode-gpus", opts.decode_gpus)):
        tp = cfg.engine.prefill_tp if role == "prefill" else cfg.engine.decode_tp
        n = tp if given is None else given
        if n > 0 and tp not in (1, n):
            raise ConfigError(f"{flag} {n} but engine.{role}_tp is {tp}: each GPU of a pod is one rank of its "
                              f"engine; set them equal, or give only one of them")
        gpus[role], tps[role] = n, (n if n > 0 else tp)
    engine = msgspec.structs.replace(cfg.engine, prefill_tp=tps["prefill"], decode_tp=tps["decode"])
    return msgspec.structs.replace(cfg, engine=engine), gpus


def memory_bytes(cfg: kcfg.KVRelayConfig, role: str, base: str) -> int:
    """An engine pod's memory: ``base`` plus what kvrelay pins or holds on top of vLLM (the
    decode node's receive pool; the store's CPU tier and deferred saves where the store runs)."""
    total = parse_size(base, "--engine-memory")
    if role == "decode":              # every decode rank has its own receive pool
        pool = parse_size(cfg.transport.pool_bytes, "transport.pool_bytes") or pods.AUTO_POOL_ESTIMATE
        total += pool * cfg.engine.decode_tp
    if cfg.store.enabled and (role == "prefill" or cfg.store.save_decoded):
        total += parse_size(cfg.store.cpu_bytes, "store.cpu_bytes") + parse_size(cfg.store.deferred_bytes,
                                                                                  "store.deferred_bytes")
    return total


def _checksum(objs: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(objs, sort_keys=True).encode()).hexdigest()


def _prometheus_rule(opts: K8sOptions) -> dict[str, Any]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": opts.meta("alerts", "metrics"),
            "spec": {"groups": groups}}


def _refusals(cfg: kcfg.KVRelayConfig, gpus: dict[str, int]) -> None:
    if not cfg.engine.model and any(gpus.values()):
        raise ConfigError("engine.model is empty, which would put the built-in tiny test model on GPU pods: set "
                          "--engine.model (a Hugging Face id or a path in the model cache)")


def render(cfg: kcfg.KVRelayConfig, opts: K8sOptions, secret: str,
           scale: scaling.ScaleOptions | None = None) -> list[dict[str, Any]]:
    """Every object, in apply order (``scale``: the optional autoscalers and route)."""
    scale = scale or scaling.ScaleOptions()
    cfg, gpus = with_gpus(cfg, opts)
    _refusals(cfg, gpus)
    tree = cluster_config(cfg, opts)
    config = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": opts.meta("config", "config"),
               "data": {"kvrelay.yaml": yaml.safe_dump(kcfg.to_dict(tree), sort_keys=False)}}]
    if not opts.existing_secret:
        config.append({"apiVersion": "v1", "kind": "Secret", "metadata": opts.meta("secret", "config"), "type": "Opaque",
                       "stringData": {"secret": secret, **({API_KEYS: "\n".join(cfg.router.api_keys) + "\n"}
                                                           if cfg.router.api_keys else {})}})
    checksum = _checksum(config)
    objs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace",
                                   "metadata": {"name": opts.namespace, "labels": {"app.kubernetes.io/part-of": pods.PART_OF}}},
                                  *config, pods.service_account(opts, "engine")]
    for role, n in (("prefill", cfg.deploy.prefill), ("decode", cfg.deploy.decode)):
        pod = pods.EnginePod(role, gpus[role], tree.engine.prefill_tp if role == "prefill" else tree.engine.decode_tp,
                             opts.engine_cpus, memory_bytes(tree, role, opts.engine_memory), cfg.engine.drain_timeout_s)
        bounds = scale.bounds(role)
        objs += [pods.headless_service(role, opts), pods.engine_deployment(pod, None if bounds else n, opts, checksum),
                 pods.disruption_budget(role, opts, {"maxUnavailable": 1})]
        if bounds:
            objs.append(scaling.autoscaler(role, bounds, scale, opts))
    objs += pods.router_objects(tree.router.port, opts, checksum)
    if scale.gateway:
        objs.append(scaling.http_route(tree.router.port, scale, opts))
    if opts.redis and cfg.store.enabled:
        objs += pods.redis_objects(opts)
    objs += pods.network_policies(tree, opts, EVENTS_PORT)
    objs.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": opts.meta("pods", "metrics"),
                 "spec": {"selector": {"matchLabels": {"app.kubernetes.io/part-of": pods.PART_OF,
                                                       "app.kubernetes.io/instance": opts.release}},
                          "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}})
    objs.append(_prometheus_rule(opts))
    return objs


def write(objs: list[dict[str, Any]], out: Path) -> list[Path]:
    try:
        return _write(objs, out)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write the manifests there: {exc.strerror or exc}") from exc


def _write(objs: list[dict[str, Any]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objs):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        if obj["kind"] == "Secret":
            path.chmod(0o600)
        paths.append(path)
    return paths


def main(args: argparse.Namespace) -> int:
    cfg = kcfg.config_from_args(args)
    opts = options_from_args(args)
    try:
        secret = Path(args.secret_file).read_text().strip() if args.secret_file else generate_secret()
    except OSError as exc:
        raise ConfigError(f"--secret-file: cannot read {args.secret_file}: {exc.strerror or exc}") from exc
    paths = write(render(cfg, opts, secret, scaling.options_from_args(args)), Path(args.out))
    print(f"kvrelay: wrote {len(paths)} manifests to {args.out} (namespace {opts.namespace}); "
          f"apply with: kubectl apply -f {args.out}")
    return 0


__all__ = ["HTTP_PORT", "KV_PORT", "SECRET_DIR", "K8sOptions", "add_args", "labels", "main", "render"]
