"""The shipped alert rules and dashboard, checked with Prometheus's own tools.

``promtool check rules`` parses every rule; ``promtool test rules`` feeds synthetic series
through them and asserts which alerts fire and which stay quiet (the rules must be able to
fail). The real-stack check - a Prometheus server scraping a running stack with a fault
injected - is ``tests/e2e/test_pd.py::test_prometheus_scrapes_the_stack_and_the_recompute_alert_fires``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "alerts.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (deploy/setup.sh installs it)")


@needs_promtool
def test_rules_parse() -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _series(name: str, values: str, **labels: str) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


@needs_promtool
def test_rules_fire_on_bad_series_and_stay_quiet_on_good_ones(tmp_path: Path) -> None:
    shutil.copy(RULES, tmp_path / "alerts.yaml")
    quiet = {"eval_time": "15m", "alertname": "KVRelayRecomputeRatioHigh", "exp_alerts": []}
    tests = {"rule_files": ["alerts.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",            # 30 % of tokens recomputed, checksum rejections, a node out
         "input_series": [_series("kvrelay_tokens_loaded_total", "0+700x20"),
                          _series("kvrelay_tokens_recomputed_total", "0+300x20"),
                          _series("kvrelay_chunks_total", "0+2x20", side="decode", outcome="checksum"),
                          _series("kvrelay_router_nodes", "1x20", pool="decode", state="out"),
                          _series("kvrelay_pool_slots_busy", "127x20", pod="d-0"),
                          _series("kvrelay_pool_slots", "127x20", pod="d-0"),
                          _series("kvrelay_router_requests_total", "0+100x20", endpoint="/v1/completions", outcome="ok"),
                          _series("kvrelay_router_request_failures_total", "0+10x20", cause="decode_failed"),
                          _series("kvrelay_store_tier_errors_total", "0+1x20", tier="redis")],
         "alert_rule_test": [
             {"eval_time": "15m", "alertname": "KVRelayRecomputeRatioHigh",
              "exp_alerts": [{"exp_labels": {"severity": "warning"}, "exp_annotations": {
                  "summary": "30% of prompt tokens recomputed on decode nodes instead of loaded",
                  "description": "Pushed KV is failing (checksums, timeouts, dead prefill nodes): PD is paying "
                                 "for prefill twice.", "runbook_url": "README.md#alerts"}}]},
             {"eval_time": "15m", "alertname": "KVRelayChecksumRejections",
              "exp_alerts": [{"exp_labels": {"severity": "critical"}, "exp_annotations": {
                  "summary": "decode nodes rejected 10 chunks for a bad checksum (corruption on the transfer path)",
                  "runbook_url": "README.md#alerts"}}]},
             {"eval_time": "15m", "alertname": "KVRelayNodesOutOfRotation",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "pool": "decode"},
                              "exp_annotations": {"summary": "1 decode node(s) failing health checks (as the routers "
                                                             "see them)", "runbook_url": "README.md#alerts"}}]},
             {"eval_time": "15m", "alertname": "KVRelayReceivePoolNearFull",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "pod": "d-0"}, "exp_annotations": {
                  "summary": "decode pod d-0's receive pool is 100% busy; pushes back off", "runbook_url": "README.md#alerts"}}]},
             {"eval_time": "15m", "alertname": "KVRelayRequestFailures",      # 10 of 100: a 5xx rate of 10 %
              "exp_alerts": [{"exp_labels": {"severity": "critical"}, "exp_annotations": {
                  "summary": "10% of requests failed at the router (5xx: nodes failing or none healthy)", "runbook_url": "README.md#alerts"}}]},
             {"eval_time": "15m", "alertname": "KVRelayStoreTierFailing",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "tier": "redis"}, "exp_annotations": {
                  "summary": "the store's redis tier failed 5 times in 5 m (Redis unreachable): every read is a miss",
                  "runbook_url": "README.md#alerts"}}]}]},
        {"interval": "1m",            # healthy: 1 % recomputed, no rejections, all nodes in
         "input_series": [_series("kvrelay_tokens_loaded_total", "0+990x20"),
                          _series("kvrelay_tokens_recomputed_total", "0+10x20"),
                          _series("kvrelay_chunks_total", "0x20", side="decode", outcome="checksum"),
                          _series("kvrelay_router_nodes", "0x20", pool="decode", state="out")],
         "alert_rule_test": [quiet, {**quiet, "alertname": "KVRelayChecksumRejections"},
                             {**quiet, "alertname": "KVRelayNodesOutOfRotation"}]},
    ]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    out = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_is_grafana_json_over_kvrelay_series() -> None:
    dash = json.loads((ROOT / "deploy" / "monitoring" / "dashboard.json").read_text())
    assert dash["panels"] and all(p["targets"] and p["datasource"]["type"] == "prometheus" for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in dash["panels"]:
        for t in p["targets"]:
            assert re.search(r"kvrelay_\w+|vllm:\w+", t["expr"]), t


def test_dashboard_takes_rates_of_counters_only_and_filters_by_namespace_pod_and_model() -> None:
    from kvrelay.core.telemetry import GAUGES

    dash = json.loads((ROOT / "deploy" / "monitoring" / "dashboard.json").read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "pod", "model_name"} <= variables
    titles = " ".join(p["title"] for p in dash["panels"])
    assert "vLLM TTFT" in titles and "vLLM ITL" in titles
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"]
            for name in re.findall(r"((?:kvrelay_|vllm:)\w+)\{", expr):
                selector = expr[expr.index(name):].split("}", 1)[0]
                assert 'namespace=~"$namespace"' in selector and 'pod=~"$pod"' in selector, (name, expr)
                windowed = re.search(rf"(rate|increase)\({re.escape(name)}\{{[^}}]*\}}\[", expr) is not None
                if name.endswith(("_total", "_bucket")):
                    assert windowed, f"a counter read raw: {expr}"
                else:
                    assert not windowed and (name in GAUGES or name.startswith("kvrelay_router_")), \
                        f"rate() of a gauge, or a series that is neither: {expr}"


def test_alerts_say_where_their_series_come_from_as_the_readme_does() -> None:
    header = RULES.read_text().split("groups:")[0]
    assert "engine's own /metrics" in header and "never beside it" in header
    readme = (ROOT / "README.md").read_text()
    assert "engine's own `/metrics`" in readme


def test_every_alert_has_a_runbook_in_the_readme_and_is_scoped_by_namespace() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    readme = (ROOT / "README.md").read_text()
    headings = {line.lstrip("#").strip().lower().replace(" ", "-") for line in readme.splitlines() if line.startswith("#")}
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("README.md#") and url.split("#", 1)[1] in headings, (rule["alert"], url)
        assert f"`{rule['alert']}`" in readme, f"{rule['alert']} has no row in the README's alert table"
        assert "by (namespace" in rule["expr"], f"{rule['alert']} is not scoped by namespace"
    names = {r["alert"] for r in rules}
    assert {"KVRelayRequestFailures", "KVRelayStoreTierFailing"} <= names
