"""Which GPUs each vLLM server gets: one device set per node, never two nodes on one device.

``kvrelay up`` places every node of its stack on the host's visible devices in order
(:func:`gpu_placement`). A pool host runs ``kvrelay serve`` once per node
(``deploy/launch_*_pool.sh``); each node derives its own set from its role's first device
(``deploy.device_offset``), its index and its TP size (:func:`node_devices`), or takes the list
``deploy.devices`` names. The visible devices are ``CUDA_VISIBLE_DEVICES`` where the operator set
it, else every GPU ``nvidia-smi`` lists; none on a CPU host, where nothing is placed. Too few is
refused before vLLM starts, by ``kvrelay serve`` and by ``kvrelay config --check``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from kvrelay.common import numa
from kvrelay.common.errors import ConfigError
from kvrelay.core.config import KVRelayConfig

AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class Node:
    """What placement needs of a node: its name, role, index among its role's and TP size."""

    name: str
    role: str
    index: int
    tp: int


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else what ``nvidia-smi -L`` lists."""
    if (env := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_placement(specs: list, devices: list[str]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for each node of a `kvrelay up` stack (``specs``: objects with
    ``name`` and ``tp``): its own ``tp`` devices, in order. ``devices``: the host's (empty on a
    CPU host: no placement). Raises ConfigError when the stack needs more than there are."""
    if not devices:
        return {}
    need = sum(s.tp for s in specs)
    if need > len(devices):
        layout = ", ".join(f"{s.name} {s.tp}" for s in specs)
        raise ConfigError(f"this stack needs {need} GPUs ({layout}) but {len(devices)} are visible "
                          f"({','.join(devices)}): lower deploy.prefill/deploy.decode or the TP sizes")
    out, nxt = {}, 0
    for s in specs:
        out[s.name] = ",".join(devices[nxt:nxt + s.tp])
        nxt += s.tp
    return out


def node_devices(cfg: KVRelayConfig, node: Node, visible: list[str]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for one ``kvrelay serve`` node, or None to leave the environment
    as it is (a CPU host, or ``deploy.devices: none``). Raises ConfigError naming the keys when
    the node's set does not fit the visible devices."""
    chosen = cfg.deploy.devices.strip()
    if chosen == NONE or (chosen == AUTO and not visible):
        return None
    if chosen != AUTO:
        listed = [d.strip() for d in chosen.split(",") if d.strip()]
        if len(listed) != node.tp:
            raise ConfigError(f"deploy.devices {chosen!r} names {len(listed)} devices for {node.name}, which runs "
                              f"tensor-parallel size {node.tp}: name exactly {node.tp}")
        if visible and (foreign := [d for d in listed if d not in visible]):
            raise ConfigError(f"deploy.devices names {','.join(foreign)}, not among the visible devices "
                              f"({','.join(visible)}: CUDA_VISIBLE_DEVICES)")
        return ",".join(listed)
    first = cfg.deploy.device_offset + node.index * node.tp
    if first + node.tp > len(visible):
        raise ConfigError(f"{node.name} (index {node.index}, TP {node.tp}) needs devices {first}..{first + node.tp - 1} "
                          f"of the visible ones, but only {len(visible)} are visible ({','.join(visible)}): fewer "
                          "nodes on this host, a smaller TP size, or deploy.device_offset / deploy.devices")
    return ",".join(visible[first:first + node.tp])


def pool_problems(cfg: KVRelayConfig, visible: list[str]) -> list[str]:
    """Each role's pool on one host (``deploy.prefill`` / ``deploy.decode`` nodes from
    ``deploy.device_offset``) against the visible devices: what ``kvrelay serve`` would refuse."""
    if not visible or cfg.deploy.devices.strip() != AUTO:
        return []
    found = []
    for role, count, tp in (("prefill", cfg.deploy.prefill, cfg.engine.prefill_tp),
                            ("decode", cfg.deploy.decode, cfg.engine.decode_tp)):
        try:
            node_devices(cfg, Node(f"{role}{count - 1}", role, count - 1, tp), visible)
        except ConfigError as exc:
            found.append(f"{role} pool of {count} x TP{tp}: {exc}")
    return found


def gpu_pci_bus_id(device: str) -> str | None:
    """The PCI address of GPU ``device`` (an index or UUID, as in ``CUDA_VISIBLE_DEVICES``), from ``nvidia-smi``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", device],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def node_numa(cfg: KVRelayConfig, devices: str | None, env: dict[str, str]) -> str:
    """What ``connector.numa_node`` resolves to for a node on ``devices`` (its first GPU's node)
    or, without one, on the cores its environment binds it to: a line for ``kvrelay serve --dry-run``."""
    first = devices.split(",")[0] if devices else None
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "").replace("|", ",")
    cpus = numa.cpulist(bind) if bind and set(bind) <= set("0123456789,-") else None
    bus = gpu_pci_bus_id(first) if first is not None else None
    node = numa.resolve(cfg.connector.numa_node, pci_bus_id=bus, cpus=cpus)
    source = f"GPU {first}'s" if bus else "its CPUs'" if cfg.connector.numa_node == numa.AUTO else "as set"
    if node is None:
        return f"NUMA: the kernel's placement (connector.numa_node {cfg.connector.numa_node}; {len(numa.nodes())} node(s))"
    return f"NUMA node {node} ({source}; connector.numa_node {cfg.connector.numa_node})"
