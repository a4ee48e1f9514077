"""`kvrelay probe`: the health a Kubernetes probe (or a load balancer) should ask for.

A node is healthy when its vLLM engine answers ``/health`` with 200 *and*, on a decode
node, its transfer endpoint accepts a connection (a decode node whose engine is up but
whose receiver is gone would take requests it cannot load KV for). Exit status 0 when
healthy, 1 otherwise, with one line saying what failed.
"""

from __future__ import annotations

import argparse
import socket
import sys
import urllib.error
import urllib.request


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="where the node listens (default: this pod / host)")
    p.add_argument("--port", type=int, required=True, help="the engine's HTTP port")
    p.add_argument("--kv-port", type=int, default=0, help="decode nodes: the transfer control port to check too")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per check")


def check(host: str, port: int, kv_port: int = 0, timeout: float = 3.0) -> str:
    """'' when healthy, else what failed."""
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status != 200:
                return f"engine {url} answered {r.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"engine {url}: {getattr(exc, 'reason', exc)}"
    if kv_port:
        try:
            socket.create_connection((host, kv_port), timeout=timeout).close()
        except OSError as exc:
            return f"transfer endpoint tcp://{host}:{kv_port}: {exc.strerror or exc}"
    return ""


def main(args: argparse.Namespace) -> int:
    why = check(args.host, args.port, args.kv_port, args.timeout)
    print(f"kvrelay probe: {why or 'healthy'}", file=sys.stderr if why else sys.stdout)
    return 1 if why else 0
