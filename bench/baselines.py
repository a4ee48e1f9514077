"""The baselines' vLLM servers: plain servers a benchmark starts beside kvrelay's and stops together.

Each starts as the leader of its own process group (as kvrelay's own servers are,
:func:`kvrelay.deploy.launch.spawn_group`), logs to ``<log_dir>/<name>.log``, and binds vLLM's
local sockets in a temporary directory of the group's (``VLLM_RPC_BASE_PATH``), emptied when they
stop and removed at exit: plain vLLM leaves seven socket files in ``/tmp`` per server start.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from kvrelay.common.private_files import RPC_BASE_ENV
from kvrelay.deploy import launch


class Servers:
    """Child vLLM servers for the baselines (started together, stopped together)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.ipc = tempfile.TemporaryDirectory(prefix="kvrelay-bench-")   # vLLM's local sockets; gone at exit

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")   # noqa: SIM115 - owned by the child
        p = launch.spawn_group(cmd, {**env, RPC_BASE_ENV: self.ipc.name}, log)   # as kvrelay's own are
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            launch.stop_group(p)
        self.procs.clear()
        for f in Path(self.ipc.name).iterdir():      # what the stopped servers left
            f.unlink(missing_ok=True)
