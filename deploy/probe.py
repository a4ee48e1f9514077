"""`kvrelay probe`: the health a Kubernetes probe (or a load balancer) should ask for.

A node is healthy when its vLLM engine answers ``/health`` with 200 *and*, on a decode
node, its transfer endpoint accepts a connection (a decode node whose engine is up but
whose receiver is gone would take requests it cannot load KV for). Exit status 0 when
healthy, 1 otherwise, with one line saying what failed.

A node that drains (SIGTERM, :mod:`kvrelay.core.drain`) answers ``/health`` with 503: not ready, so
a readiness probe takes it out of its Service. ``--liveness`` counts a draining node as
alive, so the kubelet lets it finish its in-flight work instead of restarting it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import urllib.error
import urllib.request

from kvrelay.core.drain import DRAINING_HEADER


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="where the node listens (default: this pod / host)")
    p.add_argument("--port", type=int, required=True, help="the engine's HTTP port")
    p.add_argument("--kv-port", type=int, default=0, help="decode nodes: the transfer control port to check too")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per check")
    p.add_argument("--liveness", action="store_true", help="a draining node counts as alive (liveness probes)")


def check(host: str, port: int, kv_port: int = 0, timeout: float = 3.0, liveness: bool = False) -> str:
    """'' when healthy (``liveness``: or draining), else what failed."""
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status != 200:
                return f"engine {url} answered {r.status}"
    except urllib.error.HTTPError as exc:
        phase = exc.headers.get(DRAINING_HEADER) if exc.headers else None
        if phase and liveness:
            return ""
        return f"engine {url} answered {exc.code}" + (f" ({phase})" if phase else "")
    except (urllib.error.URLError, OSError) as exc:
        return f"engine {url}: {getattr(exc, 'reason', exc)}"
    if kv_port:
        try:
            socket.create_connection((host, kv_port), timeout=timeout).close()
        except OSError as exc:
            return f"transfer endpoint tcp://{host}:{kv_port}: {exc.strerror or exc}"
    return ""


def main(args: argparse.Namespace) -> int:
    why = check(args.host, args.port, args.kv_port, args.timeout, args.liveness)
    print(f"kvrelay probe: {why or 'healthy'}", file=sys.stderr if why else sys.stdout)
    return 1 if why else 0
