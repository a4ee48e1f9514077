"""The drain state machine (deploy/supervisor.py, core/drain.py, the front door in core/guard.py).

The supervisor runs a real child process and real signals to it; only the engine's
"busy?" answer is scripted. tests/e2e/test_drain.py drains real vLLM nodes under load.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from kvrelay.core.drain import DRAINING_HEADER, DrainPhase, read_phase, write_phase
from kvrelay.core.guard import _drain_refusal, _Node
from kvrelay.deploy import probe
from kvrelay.deploy.supervisor import DrainPlan, Supervisor

# A stand-in for vLLM: exits 0 on SIGTERM (as vLLM does once drained), prints which signal.
CHILD = [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: (print('TERM', flush=True), sys.exit(0)))\n"
         "time.sleep(120)\n"]


def _start(plan: DrainPlan, busy) -> tuple[Supervisor, threading.Thread, list[int]]:
    sup = Supervisor(CHILD, {}, plan, busy)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(sup.run()), daemon=True)
    t.start()
    while sup.child is None:
        time.sleep(0.01)
    time.sleep(0.3)                                  # the child installs its handler
    return sup, t, rc


def test_sigterm_drains_while_busy_then_stops_the_engine_once_quiet(tmp_path: Path):
    f = str(tmp_path / "node.drain")
    write_phase(f, DrainPhase.STOPPING)              # stale, from a crash: cleared at start
    busy_until = [float("inf")]
    sup, t, rc = _start(DrainPlan(f, timeout_s=30, quiet_s=0.5, poll_s=0.05),
                        lambda: time.monotonic() < busy_until[0])
    assert read_phase(f) is DrainPhase.SERVING
    sup.on_sigterm()
    time.sleep(0.5)
    assert read_phase(f) is DrainPhase.DRAINING and sup.child is not None and sup.child.poll() is None
    busy_until[0] = time.monotonic() + 0.3           # the in-flight work finishes
    t0 = time.monotonic()
    t.join(10)
    assert rc == [0] and 0.5 <= time.monotonic() - t0 < 5
    assert not Path(f).exists()


def test_a_node_that_never_goes_quiet_stops_at_the_drain_timeout(tmp_path: Path):
    f = str(tmp_path / "node.drain")
    sup, t, rc = _start(DrainPlan(f, timeout_s=1.0, quiet_s=0.5, poll_s=0.05), lambda: True)
    t0 = time.monotonic()
    sup.on_sigterm()
    t.join(10)
    assert rc == [0] and 1.0 <= time.monotonic() - t0 < 5 and not Path(f).exists()


def test_a_child_that_exits_by_itself_gives_its_status(tmp_path: Path):
    sup = Supervisor([sys.executable, "-c", "raise SystemExit(3)"], {}, DrainPlan(str(tmp_path / "d"), 5, 1),
                     lambda: False)
    assert sup.run() == 3


def test_the_drain_file_phases(tmp_path: Path):
    f = tmp_path / "x.drain"
    assert read_phase(str(f)) is DrainPhase.SERVING and read_phase("") is DrainPhase.SERVING
    f.write_text("")                                  # `touch FILE` drains a node by hand
    assert read_phase(str(f)) is DrainPhase.DRAINING
    f.write_text("nonsense\n")
    assert read_phase(str(f)) is DrainPhase.DRAINING
    write_phase(str(f), DrainPhase.STOPPING)
    assert read_phase(str(f)) is DrainPhase.STOPPING
    write_phase(str(f), DrainPhase.SERVING)
    assert not f.exists()


@pytest.mark.parametrize("phase", [DrainPhase.DRAINING, DrainPhase.STOPPING])
def test_the_front_door_while_draining(phase: DrainPhase):
    pull = {"kvrelay": {"role": "pull"}}
    decode, prefill = _Node(None, False, "f"), _Node(None, True, "f")   # type: ignore[arg-type]
    assert _drain_refusal(decode, phase, "/health", None).status_code == 503
    assert _drain_refusal(decode, phase, "/metrics", None) is None
    refused = _drain_refusal(prefill, phase, "/v1/completions", {"kvrelay": {}})
    assert refused.status_code == 503 and refused.headers[DRAINING_HEADER] == phase.value
    assert _drain_refusal(decode, phase, "/v1/chat/completions", None).status_code == 503
    admitted = _drain_refusal(decode, phase, "/v1/completions", pull)
    assert (admitted is None) == (phase is DrainPhase.DRAINING)   # loads aimed here finish while DRAINING


def test_probe_liveness_accepts_a_draining_node_and_readiness_does_not():
    class Draining(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(503)
            self.send_header(DRAINING_HEADER, "draining")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Draining)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert "503 (draining)" in probe.check("127.0.0.1", port)
        assert probe.check("127.0.0.1", port, liveness=True) == ""
    finally:
        server.shutdown()


def test_kvrelay_serve_dry_run_has_the_shutdown_timeout():
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", "decode", "--dry-run",
                          "--engine.drain_timeout_s", "42"], capture_output=True, text=True,
                         env={"KVRELAY_SECRET": "x" * 32, "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert "--shutdown-timeout 42" in out and '"drain_file": "/' in out
