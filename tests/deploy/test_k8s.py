"""`kvrelay deploy k8s`: manifests rendered from the config tree, validated offline.

Every built-in kind is checked with ``kubernetes-validate`` in strict mode (unknown fields
are errors) against a current Kubernetes release; the PodMonitor is a prometheus-operator
CRD, whose schema that package does not carry, so its shape is checked by hand. The
ConfigMap's config must load as a kvrelay config (unknown keys are errors there too), and
the probes are exercised for real against a listening engine and transfer port.
"""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kvrelay.core import config as kcfg
from kvrelay.deploy import k8s, probe

VERSION = k8s.K8S_VERSION


def _render(tmp: Path, *flags: str) -> dict[str, dict]:
    out = tmp / "k8s"
    subprocess.run([sys.executable, "-m", "kvrelay.cli", "deploy", "k8s", "--out", str(out), "--namespace", "llm",
                    *flags], check=True, capture_output=True, text=True)
    objs = {}
    for path in sorted(out.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        objs[f"{obj['kind']}/{obj['metadata']['name']}"] = obj
        if obj["kind"] == "Secret":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the rendered Secret must not be world-readable"
    return objs


def test_manifests_validate_strictly_and_carry_the_deployment(tmp_path: Path) -> None:
    objs = _render(tmp_path, "--deploy.prefill", "2", "--deploy.decode", "3", "--gpus-per-pod", "4",
                   "--store.enabled", "true", "--redis", "--engine.model", "meta-llama/Llama-3.1-8B-Instruct")
    for obj in objs.values():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(obj, VERSION, strict=True)      # raises ValidationError, naming the field
    assert {k.split("/")[0] for k in objs} >= {"ConfigMap", "Secret", "Service", "Deployment",
                                               "PodDisruptionBudget", "PodMonitor"}
    dec, pre = objs["Deployment/kvrelay-decode"], objs["Deployment/kvrelay-prefill"]
    assert dec["spec"]["replicas"] == 3 and pre["spec"]["replicas"] == 2
    c = dec["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["args"][-2:] == ["--transport.advertise_host", "$(POD_IP)"]
    assert c["readinessProbe"]["exec"]["command"][-2:] == ["--kv-port", str(k8s.KV_PORT)]
    assert c["livenessProbe"]["exec"]["command"][-1] == "--liveness"        # a draining pod is alive
    assert dec["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120 + 45   # drain_timeout_s + 45
    assert objs["Service/kvrelay-decode"]["spec"]["clusterIP"] == "None"
    cfg = kcfg.from_dict(yaml.safe_load(objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]))
    assert cfg.router.decode == [f"dns+http://kvrelay-decode.llm.svc.cluster.local:{k8s.HTTP_PORT}"
                                 f"=tcp://kvrelay-decode.llm.svc.cluster.local:{k8s.KV_PORT}"]
    assert cfg.engine.extra_args[-2:] == ["--tensor-parallel-size", "4"]
    assert cfg.transport.secret_file.startswith(k8s.SECRET_DIR) and cfg.store.redis_url.startswith("redis://kvrelay-redis")
    assert kcfg.push_allowlist(cfg) == [f"tcp://kvrelay-decode.llm.svc.cluster.local:{k8s.KV_PORT}"]
    secret = objs["Secret/kvrelay-secret"]["stringData"]["secret"]
    assert len(secret) >= 32 and secret not in objs["ConfigMap/kvrelay-config"]["data"]["kvrelay.yaml"]
    pm = objs["PodMonitor/kvrelay"]["spec"]
    assert pm["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "kvrelay"}
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
        kubernetes_validate.validate(dep, VERSION, strict=True)


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
            kubernetes_validate.validate(obj, VERSION, strict=True)
