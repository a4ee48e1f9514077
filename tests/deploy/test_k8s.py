"""`kvrelay deploy k8s`: manifests rendered from the config tree, validated offline.

Every built-in kind is checked with ``kubernetes-validate`` in strict mode (unknown fields
are errors) against a current Kubernetes release; the PodMonitor is a prometheus-operator
CRD, whose schema that package does not carry, so its shape is checked by hand. The
ConfigMap's config must load as a kvrelay config (unknown keys are errors there too), and
the probes are exercised for real against a listening engine and transfer port.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as ku
import pytest
import yaml
from referencing import Registry, Resource

from kvrelay import cli
from kvrelay.core import config as kcfg
from kvrelay.deploy import k8s, launch, probe

VERSIONS = k8s.K8S_VERSIONS


def _validate(obj: dict) -> None:
    """Strictly (unknown fields are errors) against every Kubernetes release supported."""
    for version in VERSIONS:
        validator, release = _validator(obj["kind"], obj["apiVersion"], version)
        try:
            validator.validate(obj)
        except jsonschema.ValidationError as exc:                      # as kubernetes_validate.validate raises it
            raise kubernetes_validate.ValidationError(exc, version=release) from exc


@functools.cache
def _validator(kind: str, api_version: str, version: str) -> tuple[jsonschema.Validator, str]:
    """kubernetes-validate's strict schema of ``kind`` for release ``version``, built once: its own
    ``validate`` reads the release's multi-megabyte definitions file again on every call, which
    was most of this module's time. The schema files and how one is picked are the package's
    (``kubernetes_validate.utils.validate``): the newest release it carries not newer than ``version``."""
    release = [v for v in ku.all_versions() if ku.major_minor(v) <= ku.major_minor(version)][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)       # rbac.authorization.k8s.io/v1 -> rbac-v1
    folder = f"kubernetes-json-schema/v{release}-local-strict"
    schema = ku.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    registry = Resource.from_contents(ku.schema_contents(f"{folder}/_definitions.json", version)) @ (
        Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry), ku.major_minor(release)


def _render(tmp: Path, *flags: str) -> dict[str, dict]:
    out = tmp / "k8s"
    model = () if "--engine.model" in flags else ("--engine.model", "org/model")    # GPU pods refuse the tiny one
    # the CLI's own entry point, in this process (a subprocess each was a second of imports a render);
    # the tests below that check exit codes and --help run it as a user does
    assert cli.main(["deploy", "k8s", "--out", str(out), "--namespace", "llm", *model, *flags]) == 0
    objs = {}
    for path in sorted(out.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        objs[f"{obj['kind']}/{obj['metadata']['name']}"] = obj
        if obj["kind"] == "Secret":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the rendered Secret must not be world-readable"
    return objs


def test_manifests_validate_strictly_and_carry_the_deployment(tmp_path: Path) -> None:
    objs = _render(tmp_path, "--deploy.prefill", "2", "--deploy.decode", "3", "--transport.pool-bytes", "8GiB",
                   "--store.enabled", "true", "--store.cpu-bytes", "4GiB", "--redis",
                   "--engine.model", "meta-llama/Llama-3.1-8B-Instruct")
    for obj in objs.values():
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate(obj)
    assert {k.split("/")[0] for k in objs} >= {"Namespace", "ConfigMap", "Secret", "Service", "Deployment",
                                               "PodDisruptionBudget", "PodMonitor", "PrometheusRule",
                                               "NetworkPolicy"}
    assert next(iter(objs)) == "Namespace/llm"                       # applied first
    dec, pre = objs["Deployment/kvrelay-decode"], objs["Deployment/kvrelay-prefill"]
    assert dec["spec"]["replicas"] == 3 and pre["spec"]["replicas"] == 2
    c = dec["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the pinned receive pool (decode) and the store's CPU tier (prefill) count against memory from start-up
    deferred = 8                                                      # store.deferred_bytes default, MiB
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == f"{(32 + 8) * 1024}Mi"
    pc = pre["spec"]["template"]["spec"]["containers"][0]
    assert pc["resources"]["requests"]["memory"] == f"{(32 + 4) * 1024 + deferred}Mi"
    assert c["args"][-2:] == ["--transport.advertise_host", "$(POD_IP)"]
    assert c["readinessProbe"]["exec"]["command"][-2:] == ["--kv-port", str(k8s.KV_PORT)]
    assert c["livenessProbe"]["exec"]["command"][-1] == "--liveness"        # a draining pod is alive
    assert dec["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120 + 45   # drain_timeout_s + 45
    assert objs["Service/kvrelay-decode"]["spec"]["clusterIP"] == "None"
    cfg = kcfg.from_dict(yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    assert cfg.router.decode == [f"dns+http://kvrelay-decode.llm.svc.cluster.local:{k8s.HTTP_PORT}"
                                 f"=tcp://kvrelay-decode.llm.svc.cluster.local:{k8s.KV_PORT}"]
    assert cfg.transport.secret_file.startswith(k8s.SECRET_DIR) and cfg.store.redis_url.startswith("redis://kvrelay-redis")
    assert kcfg.push_allowlist(cfg) == [f"tcp://kvrelay-decode.llm.svc.cluster.local:{k8s.KV_PORT}"]
    secret = objs["Secret/kvrelay-secret"]["stringData"]["secret"]
    assert len(secret) >= 32 and secret not in objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]
    pm = objs["PodMonitor/kvrelay-pods"]["spec"]
    assert pm["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "kvrelay", "app.kubernetes.io/instance": "kvrelay"}
    assert pm["podMetricsEndpoints"][0]["path"] == "/metrics"
    for role in ("prefill", "decode"):
        assert objs[f"PodDisruptionBudget/kvrelay-{role}"]["spec"]["maxUnavailable"] == 1


def test_cache_aware_routing_follows_the_prefill_pods_store_events(tmp_path: Path) -> None:
    # With the store on, every prefill pod publishes its store events on one port and the
    # router's DNS entry names it, so the router subscribes to each pod it discovers; without
    # the store there is nothing to route by, and the router balances by load.
    objs = _render(tmp_path, "--store.enabled", "true", "--router.policy", "cache_aware",
                   "--engine.model", "meta-llama/Llama-3.1-8B-Instruct")
    cfg = kcfg.from_dict(yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    name = "kvrelay-prefill.llm.svc.cluster.local"
    assert cfg.router.policy is kcfg.RoutingPolicy.CACHE_AWARE and cfg.store.publish_port == k8s.EVENTS_PORT
    assert cfg.router.prefill == [f"dns+http://{name}:{k8s.HTTP_PORT}=tcp://{name}:{k8s.EVENTS_PORT}"]
    assert cfg.router.tokenizer == "meta-llama/Llama-3.1-8B-Instruct"
    objs = _render(tmp_path / "nostore", "--router.policy", "cache_aware")
    cfg = kcfg.from_dict(yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    assert cfg.router.policy is kcfg.RoutingPolicy.LEAST_OUTSTANDING and "=" not in cfg.router.prefill[0]


def test_a_broken_manifest_is_caught_by_the_validator(tmp_path: Path) -> None:
    # The check must be able to fail: an unknown field and a wrong type in the rendered pod.
    dep = _render(tmp_path)["Deployment/kvrelay-decode"]
    dep["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(dep)


def test_probe_needs_the_engine_and_the_transfer_endpoint() -> None:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    kv = socket.create_server(("127.0.0.1", 0))
    free = socket.create_server(("127.0.0.1", 0))
    dead_port = free.getsockname()[1]
    free.close()
    try:
        port, kv_port = http.server_address[1], kv.getsockname()[1]
        assert probe.check("127.0.0.1", port, kv_port) == ""
        assert "transfer endpoint" in probe.check("127.0.0.1", port, dead_port)
        assert "engine" in probe.check("127.0.0.1", dead_port, kv_port)
        rc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "probe", "--port", str(port), "--kv-port",
                             str(dead_port)], capture_output=True, text=True)
        assert rc.returncode == 1 and "transfer endpoint" in rc.stderr
    finally:
        http.shutdown()
        kv.close()


def test_client_keys_go_to_the_secret_and_draining_decode_pods_stay_listed(tmp_path: Path) -> None:
    conf = tmp_path / "kvrelay.yaml"
    conf.write_text("router:\n  api_keys: [sk-k8s-one, sk-k8s-two]\n")
    objs = _render(tmp_path, "--config", str(conf))
    text = objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]
    assert "sk-k8s" not in text
    cfg = kcfg.from_dict(yaml.safe_load(text))
    assert cfg.router.api_keys == [] and cfg.router.api_keys_file == f"{k8s.SECRET_DIR}/{k8s.API_KEYS}"
    assert objs["Secret/kvrelay-secret"]["stringData"][k8s.API_KEYS].split() == ["sk-k8s-one", "sk-k8s-two"]
    # a draining (not ready) decode pod still finishes its streams: it stays in P's push allowlist
    assert objs["Service/kvrelay-decode"]["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in objs["Service/kvrelay-prefill"]["spec"]
    for obj in objs.values():
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate(obj)


def _pod(objs: dict[str, dict], name: str) -> dict:
    return objs[f"Deployment/{name}"]["spec"]["template"]


def test_cluster_options_reach_the_pods(tmp_path: Path) -> None:
    objs = _render(tmp_path, "--node-selector", "gpu=h100", "--toleration", "nvidia.com/gpu:NoSchedule",
                   "--toleration", "dedicated=llm:NoExecute", "--rdma-resource", "rdma/hca_shared_devices_a",
                   "--ucx-net-devices", "mlx5_0:1", "--model-cache-pvc", "models", "--hf-token-secret", "hf",
                   "--decode-gpus", "0")
    for obj in objs.values():
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate(obj)
    for role in ("prefill", "decode"):
        spec = _pod(objs, f"kvrelay-{role}")["spec"]
        c = spec["containers"][0]
        assert spec["nodeSelector"] == {"gpu": "h100"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                       {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}]
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        env = {e["name"]: e for e in c["env"]}
        assert env["UCX_NET_DEVICES"]["value"] == "mlx5_0:1"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token", "optional": True}
        cache = next(v for v in spec["volumes"] if v["name"] == "model-cache")
        assert cache["persistentVolumeClaim"] == {"claimName": "models"}
        assert env["HF_HOME"]["value"].startswith(next(m["mountPath"] for m in c["volumeMounts"]
                                                       if m["name"] == "model-cache"))
    assert "nvidia.com/gpu" not in _pod(objs, "kvrelay-decode")["spec"]["containers"][0]["resources"]["limits"]
    assert _pod(objs, "kvrelay-prefill")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_two_routers_with_a_budget_and_pods_roll_when_the_config_changes(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    one = _render(tmp_path / "a", "--secret-file", str(secret))
    same = _render(tmp_path / "b", "--secret-file", str(secret))
    other = _render(tmp_path / "c", "--secret-file", str(secret), "--router.max-migrations", "1")
    assert one["Deployment/kvrelay-router"]["spec"]["replicas"] == 2
    assert one["PodDisruptionBudget/kvrelay-router"]["spec"]["minAvailable"] == 1
    key = "kvrelay.io/config-sha256"
    for name in ("kvrelay-prefill", "kvrelay-decode", "kvrelay-router"):
        assert _pod(one, name)["metadata"]["annotations"][key] == _pod(same, name)["metadata"]["annotations"][key]
        assert _pod(one, name)["metadata"]["annotations"][key] != _pod(other, name)["metadata"]["annotations"][key]


def test_decode_first_engines_publish_kv_events_to_the_routers_alone(tmp_path: Path) -> None:
    # Decode-first is the default (router.decode_first auto). Pods come and go, so the routers
    # cannot bind an endpoint per engine: every engine pod binds one port for vLLM's KV events
    # and each router subscribes to the pods it resolves; the events carry prompt token ids, so
    # only router pods may reach that port.
    from kvrelay.router.decide import switched_on

    objs = _render(tmp_path, "--engine.model", "meta-llama/Llama-3.1-8B-Instruct")
    for obj in objs.values():
        if obj["kind"] not in ("PodMonitor", "PrometheusRule"):      # CRDs: no schema in kubernetes-validate
            _validate(obj)
    cfg = kcfg.from_dict(yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    assert cfg.router.decode_first is None and switched_on(cfg.router) == (True, "auto: the router follows the engines' KV events")
    assert cfg.router.kv_events_port == k8s.KV_EVENTS_PORT and not cfg.router.kv_events
    assert cfg.router.tokenizer == "meta-llama/Llama-3.1-8B-Instruct"
    for spec in launch.node_specs(cfg):        # what `kvrelay serve` starts in each engine pod
        cmd = launch.server_command(cfg, spec)
        events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        assert events["endpoint"] == f"tcp://*:{k8s.KV_EVENTS_PORT}" and events["publisher"] == "zmq"
    routers = [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvrelay",
                                                "app.kubernetes.io/instance": "kvrelay",
                                                "app.kubernetes.io/component": "router"}}}]
    for role in ("prefill", "decode"):
        by_port = {p["port"]: rule["from"] for rule in objs[f"NetworkPolicy/kvrelay-{role}"]["spec"]["ingress"]
                   for p in rule["ports"]}
        assert by_port[k8s.KV_EVENTS_PORT] == routers, role
    off = kcfg.from_dict(yaml.safe_load(_render(tmp_path / "off", "--router.decode-first", "false")
                                        ["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    assert off.router.decode_first is False and off.router.kv_events_port == 0


def k8s_pods_http(objs: dict, role: str) -> list:
    return next(rule["from"] for rule in objs[f"NetworkPolicy/kvrelay-{role}"]["spec"]["ingress"]
                for p in rule["ports"] if p["port"] == k8s.HTTP_PORT)


def test_network_policies_keep_the_data_plane_inside_the_stack(tmp_path: Path) -> None:
    objs = _render(tmp_path, "--store.enabled", "true", "--router.policy", "cache_aware", "--redis",
                   "--engine.model", "m")
    stack = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvrelay", "app.kubernetes.io/instance": "kvrelay"}}}
    decode = objs["NetworkPolicy/kvrelay-decode"]["spec"]
    assert decode["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    by_port = {p["port"]: rule["from"] for rule in decode["ingress"] for p in rule["ports"]}
    assert by_port[k8s.KV_PORT] == [stack] and by_port[k8s.KV_PORT + 100] == [stack]
    # an engine's HTTP port is also vLLM's unauthenticated API: the routers and Prometheus's pods alone
    # (before: the whole stack and every pod of the monitoring namespace)
    routers = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvrelay",
                                               "app.kubernetes.io/instance": "kvrelay",
                                               "app.kubernetes.io/component": "router"}}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    assert by_port[k8s.HTTP_PORT] == [routers, prometheus]
    assert k8s_pods_http(objs, "prefill") == [routers, prometheus]
    prefill = {p["port"]: rule["from"] for rule in objs["NetworkPolicy/kvrelay-prefill"]["spec"]["ingress"]
               for p in rule["ports"]}
    assert prefill[k8s.EVENTS_PORT] == [stack]
    redis = objs["NetworkPolicy/kvrelay-redis"]["spec"]["ingress"]
    assert redis == [{"from": [stack], "ports": [{"protocol": "TCP", "port": 6379}]}]
    rule = objs["PrometheusRule/kvrelay-alerts"]["spec"]["groups"]
    assert rule == yaml.safe_load(k8s.ALERTS.read_text())["groups"]


def test_gpus_per_role_set_each_engines_tensor_parallel_size(tmp_path: Path) -> None:
    objs = _render(tmp_path, "--prefill-gpus", "2", "--decode-gpus", "4")
    for obj in objs.values():
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate(obj)
    tree = yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"])
    assert (tree["engine"]["prefill_tp"], tree["engine"]["decode_tp"]) == (2, 4)
    limits = {r: _pod(objs, f"kvrelay-{r}")["spec"]["containers"][0]["resources"]["limits"] for r in ("prefill", "decode")}
    assert limits["prefill"]["nvidia.com/gpu"] == 2 and limits["decode"]["nvidia.com/gpu"] == 4
    ports = {p["containerPort"] for p in _pod(objs, "kvrelay-decode")["spec"]["containers"][0]["ports"]}
    assert {k8s.KV_PORT + r for r in range(4)} | {k8s.KV_PORT + 100 + r for r in range(4)} <= ports
    allowed = {p["port"] for rule in objs["NetworkPolicy/kvrelay-decode"]["spec"]["ingress"] for p in rule["ports"]}
    assert {k8s.KV_PORT + r for r in range(4)} <= allowed
    from_yaml = _render(tmp_path / "y", "--engine.prefill_tp", "2")          # the TP key alone sets the GPUs
    pre = _pod(from_yaml, "kvrelay-prefill")["spec"]["containers"][0]["resources"]["limits"]
    assert pre["nvidia.com/gpu"] == 2


def test_gpus_that_contradict_the_tp_key_are_refused(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "deploy", "k8s", "--out", str(tmp_path), "--decode-gpus",
                          "4", "--engine.decode_tp", "2"], capture_output=True, text=True)
    assert res.returncode == 2 and "engine.decode_tp" in res.stderr and "Traceback" not in res.stderr


def test_two_releases_share_a_namespace_and_an_existing_secret_is_referenced_not_rendered(tmp_path: Path) -> None:
    a = _render(tmp_path / "a", "--release", "a", "--redis", "--store.enabled", "true")
    b = _render(tmp_path / "b", "--release", "b", "--existing-secret", "llm-kv-secret")
    objects = lambda objs: {k for k in objs if not k.startswith("Namespace/")}     # noqa: E731 - the one namespace
    assert not objects(a) & objects(b), objects(a) & objects(b)
    assert not [k for k in b if k.startswith("Secret/")] and not list((tmp_path / "b" / "k8s").glob("*secret*"))
    for objs, release in ((a, "a"), (b, "b")):
        for obj in objs.values():
            if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
                _validate(obj)
        for dep in (o for k, o in objs.items() if k.startswith("Deployment/")):
            assert dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == release
            pod = dep["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
            assert pod.get("automountServiceAccountToken") is False
            for c in pod["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
                assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
    secret_vol = next(v for v in b["Deployment/b-decode"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "secret")
    assert secret_vol["secret"]["secretName"] == "llm-kv-secret"
    cfg = kcfg.from_dict(yaml.safe_load(b["ConfigMap/b-config"]["data"]["kvrelay.yaml"]))
    assert cfg.router.prefill[0].startswith("dns+http://b-prefill.llm.svc.cluster.local:")
    gpu = a["Deployment/a-decode"]["spec"]["strategy"]["rollingUpdate"]
    assert gpu == {"maxUnavailable": 1, "maxSurge": 0}             # a full cluster has no GPU for a surge pod


@pytest.mark.parametrize(("flags", "says"), [
    (["--namespace", "Bad_NS"], "--namespace 'Bad_NS': lower-case letters"),
    (["--release", "x" * 50], "--release"),
    (["--engine-cpus", "lots"], "--engine-cpus 'lots'"),
    (["--engine-memory", "lots"], "--engine-memory"),
    (["--image", ""], "--image ''"),
    (["--existing-secret", "Not A Name"], "--existing-secret"),
    (["--out", "/etc/passwd"], "--out /etc/passwd: cannot write the manifests there"),
    (["--engine.model", ""], "engine.model is empty"),
    (["--autoscale-decode", "8:2"], "--autoscale-decode '8:2': expected MIN:MAX"),
    (["--autoscale-prefill", "lots"], "--autoscale-prefill 'lots'"),
    (["--gateway", "Bad/Gw"], "--gateway 'Bad/Gw'"),
    (["--gateway", "gw", "--hostname", "no_such host"], "--hostname 'no_such host'"),
], ids=["namespace", "release", "cpus", "memory", "image", "secret", "out", "tiny-on-gpu", "autoscale-bounds",
        "autoscale-text", "gateway", "hostname"])
def test_invalid_input_exits_2_with_one_line(tmp_path: Path, flags: list[str], says: str) -> None:
    out = ["--out", str(tmp_path / "k8s")] if "--out" not in flags else []
    model = [] if "--engine.model" in flags else ["--engine.model", "org/model"]
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "deploy", "k8s", *out, *model, *flags],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_autoscalers_and_a_gateway_route_render_on_request_and_validate(tmp_path: Path) -> None:
    # HPAs per pool on vLLM's waiting requests (built-in kind: validated strictly); the
    # Deployments then carry no replica count for a re-apply to reset. The HTTPRoute is a
    # Gateway API CRD (no schema in kubernetes-validate): its shape is checked here.
    objs = _render(tmp_path, "--release", "r1", "--autoscale-prefill", "1:4", "--autoscale-decode", "2:8",
                   "--autoscale-waiting", "1.5", "--gateway", "infra/public", "--hostname", "llm.example.com")
    for obj in objs.values():
        if obj["apiVersion"].split("/")[0] not in ("monitoring.coreos.com", "gateway.networking.k8s.io"):
            _validate(obj)
    for role, low, high in (("prefill", 1, 4), ("decode", 2, 8)):
        hpa = objs[f"HorizontalPodAutoscaler/r1-{role}"]["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"r1-{role}"}
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (low, high)
        metric = hpa["metrics"][0]["pods"]
        assert metric == {"metric": {"name": "vllm_num_requests_waiting"},
                          "target": {"type": "AverageValue", "averageValue": "1500m"}}
        assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300    # leaving pods drain first
        assert "replicas" not in objs[f"Deployment/r1-{role}"]["spec"]
    assert objs["Deployment/r1-router"]["spec"]["replicas"] == 2
    route = objs["HTTPRoute/r1-router"]
    assert route["metadata"]["namespace"] == "llm"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "infra"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    port = objs["Service/r1-router"]["spec"]["ports"][0]["port"]
    assert rule["backendRefs"] == [{"name": "r1-router", "port": port}]
    assert rule["timeouts"] == {"request": "0s"}                       # answers stream as long as they take
    plain = _render(tmp_path / "plain")
    assert not any(k.startswith(("HorizontalPodAutoscaler/", "HTTPRoute/")) for k in plain)
    assert plain["Deployment/kvrelay-decode"]["spec"]["replicas"] == 1


def test_help_lists_every_object_it_renders() -> None:
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "deploy", "k8s", "--help"], capture_output=True, text=True)
    for kind in ("Namespace", "ConfigMap", "ServiceAccount", "Deployments", "PodDisruptionBudgets", "NetworkPolicies",
                 "PodMonitor", "PrometheusRule", "--existing-secret", "HorizontalPodAutoscaler", "HTTPRoute"):
        assert kind in res.stdout, kind
