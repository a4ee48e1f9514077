"""Where a node's vLLM keeps its local sockets, and what is removed when it stops.

vLLM binds the ZeroMQ sockets between its API server, engine core and workers as Unix socket
files named by a fresh UUID under ``VLLM_RPC_BASE_PATH`` (default: the shared temporary
directory) and leaves them there when it stops, by any signal: seven files per server in
vLLM 0.32, thousands on a host that restarts nodes. The prefill connector's store lookup
socket (:func:`kvrelay.prefill.lookup.lookup_endpoint`) sits beside them.

Contract:

* :func:`ipc_dir` is node ``spec``'s own directory for them, inside the private runtime
  directory (:mod:`kvrelay.common.private_files`): no other local user can list, connect to
  or squat on them. ``kvrelay serve`` points ``VLLM_RPC_BASE_PATH`` there unless the operator
  set it.
* :func:`scratch` names that directory and the node's other leftovers (a KV-events Unix
  socket, the logging config ``kvrelay serve`` writes) for the supervisor, which empties the
  directory before vLLM starts and removes all of it once vLLM has exited
  (:class:`kvrelay.deploy.supervisor.Scratch`).
* A Unix socket's path holds at most 107 bytes; a runtime directory too long for vLLM's names
  in it is a :class:`~kvrelay.common.errors.ConfigError` at start, naming the setting.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvrelay.common.errors import ConfigError
from kvrelay.common.private_files import RPC_BASE_ENV, runtime_dir_path
from kvrelay.core.config import KVRelayConfig
from kvrelay.deploy.launch import NodeSpec, kv_events_endpoint, vllm_logging_path
from kvrelay.deploy.supervisor import Scratch

__all__ = ["RPC_BASE_ENV", "ipc_dir", "scratch"]
SOCKET_PATH_MAX = 107                   # bytes in sockaddr_un.sun_path, less the NUL
LONGEST_NAME = 1 + 36                   # "/" and a UUID: vLLM's names, the longest bound in it


def ipc_dir(cfg: KVRelayConfig, spec: NodeSpec) -> Path:
    """Node ``spec``'s directory for vLLM's local sockets (not created here)."""
    base = runtime_dir_path(cfg.connector.runtime_dir)
    path = base / f"{spec.name}-{spec.port}.ipc"
    if len(os.fsencode(path)) + LONGEST_NAME > SOCKET_PATH_MAX:
        raise ConfigError(f"connector.runtime_dir {str(base)!r} is too long: vLLM binds Unix sockets in "
                          f"{path}, and a socket's path holds at most {SOCKET_PATH_MAX} bytes; "
                          "choose a shorter directory")
    return path


def scratch(cfg: KVRelayConfig, spec: NodeSpec, env: dict[str, str]) -> Scratch:
    """What the supervisor of node ``spec`` clears: its socket directory when ``env`` points vLLM
    there, an ``ipc://`` KV-events socket, and the JSON logging config beside the drain file."""
    own = ipc_dir(cfg, spec)
    dirs = (own,) if env.get(RPC_BASE_ENV) == str(own) else ()
    events = kv_events_endpoint(cfg, spec)
    files = [Path(vllm_logging_path(cfg, spec))]
    if events.startswith("ipc://"):
        files.append(Path(events.removeprefix("ipc://")))
    return Scratch(dirs, tuple(files))
