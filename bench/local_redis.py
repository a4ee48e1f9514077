"""A throwaway local redis-server for tests and benchmarks (no persistence, a free port, its own dir)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REDIS = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(workdir: Path, port: int = 0, password: str = "",
                 tls: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start redis-server on ``port`` (0 = a free one); yield (url, process); kill it on exit. Needs ``REDIS``.
    ``password``: require AUTH (set in a 0600 config file, not on the command line). ``tls``: serve
    only TLS (``rediss://``) with a self-signed certificate written to ``workdir/redis-ca.pem``."""
    assert REDIS is not None, "redis-server not installed (deploy/setup.sh installs it)"
    import redis

    port = port or free_port()
    conf = Path(workdir) / f"redis-{port}.conf"
    lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {workdir}"]
    lines += [f"requirepass {password}"] if password else []
    lines += _tls_lines(Path(workdir), port) if tls else []
    conf.write_text("\n".join(lines) + "\n")
    conf.chmod(0o600)
    proc = subprocess.Popen([REDIS, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
    extra = {"ssl_ca_certs": str(Path(workdir) / "redis-ca.pem")} if tls else {}
    try:
        for _ in range(200):
            try:
                redis.Redis.from_url(url, password=password or None, **extra).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def _tls_lines(workdir: Path, port: int) -> list[str]:
    """A self-signed certificate for 127.0.0.1 (needs the ``openssl`` command) and the config to use it."""
    cert, key = workdir / "redis-ca.pem", workdir / "redis-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return ["port 0", f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}", f"tls-ca-cert-file {cert}",
            "tls-auth-clients no"]
