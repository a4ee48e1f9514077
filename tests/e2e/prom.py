"""A real Prometheus server for tests: scrapes given targets every second, evaluates rules."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvrelay.deploy import launch

RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "alerts.yaml"


def fast_rules(dst: Path) -> Path:
    """The shipped rules with test-sized windows: ``[5m]`` -> ``[20s]``, every ``for:`` -> 0s.
    The expressions themselves are unchanged."""
    text = re.sub(r"\[\d+m\]", "[20s]", RULES.read_text())
    dst.write_text(re.sub(r"for: \d+m", "for: 0s", text))
    return dst


@contextlib.contextmanager
def prometheus(tmp: Path, targets: list[str], port: int) -> Iterator[str]:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed (deploy/setup.sh installs the Debian package)")
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(fast_rules(tmp / "rules.yaml"))],
           "scrape_configs": [{"job_name": "kvrelay", "static_configs": [{"targets": targets}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 - owned by the child
    proc = launch.spawn_group([exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(url, proc, 60, str(tmp / "prometheus.log"), path="/-/ready")
        yield url
    finally:
        launch.stop_group(proc)


def api(url: str, path: str, **params: str) -> dict:
    q = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return dict(body["data"]) if isinstance(body["data"], dict) else {"result": body["data"]}


def firing(url: str) -> set[str]:
    return {a["labels"]["alertname"] for a in api(url, "alerts")["alerts"] if a["state"] == "firing"}
