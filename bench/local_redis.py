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
def redis_server(workdir: Path, port: int = 0, password: str = "") -> Iterator[tuple[str, subprocess.Popen]]:
    """Start redis-server on ``port`` (0 = a free one); yield (url, process); kill it on exit. Needs ``REDIS``.
    ``password``: require AUTH (set in a 0600 config file, not on the command line)."""
    assert REDIS is not None, "redis-server not installed (deploy/setup.sh installs it)"
    import redis

    port = port or free_port()
    conf = Path(workdir) / f"redis-{port}.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\ndir {workdir}\n"
                    + (f"requirepass {password}\n" if password else ""))
    conf.chmod(0o600)
    proc = subprocess.Popen([REDIS, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(200):
            try:
                redis.Redis.from_url(url, password=password or None).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()
