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


class RedisServer:
    """One redis-server on a fixed port, stopped and started again on demand (the soak's Redis
    fault: a restarted server comes back empty, as one without persistence does)."""

    def __init__(self, workdir: Path, port: int = 0, password: str = "", tls: bool = False) -> None:
        assert REDIS is not None, "redis-server not installed (deploy/setup.sh installs it)"
        self.port, self.password = port or free_port(), password
        self.conf = Path(workdir) / f"redis-{self.port}.conf"
        lines = [f"port {self.port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {workdir}"]
        lines += [f"requirepass {password}"] if password else []
        lines += _tls_lines(Path(workdir), self.port) if tls else []
        self.conf.write_text("\n".join(lines) + "\n")
        self.conf.chmod(0o600)
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.port}/0"
        self.extra = {"ssl_ca_certs": str(Path(workdir) / "redis-ca.pem")} if tls else {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server and wait (up to 10 s) until it answers PING."""
        import redis

        self.proc = subprocess.Popen([str(REDIS), str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        for _ in range(200):
            try:
                redis.Redis.from_url(self.url, password=self.password or None, **self.extra).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL the server (what it held is gone)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def redis_server(workdir: Path, port: int = 0, password: str = "",
                 tls: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start redis-server on ``port`` (0 = a free one); yield (url, process); kill it on exit. Needs ``REDIS``.
    ``password``: require AUTH (set in a 0600 config file, not on the command line). ``tls``: serve
    only TLS (``rediss://``) with a self-signed certificate written to ``workdir/redis-ca.pem``."""
    server = RedisServer(workdir, port, password, tls)
    try:
        server.start()
        assert server.proc is not None
        yield server.url, server.proc
    finally:
        server.stop()


def _tls_lines(workdir: Path, port: int) -> list[str]:
    """A self-signed certificate for 127.0.0.1 (needs the ``openssl`` command) and the config to use it."""
    cert, key = workdir / "redis-ca.pem", workdir / "redis-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return ["port 0", f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}", f"tls-ca-cert-file {cert}",
            "tls-auth-clients no"]
