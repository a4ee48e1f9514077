"""NUMA placement of the host buffers a node keeps: the receive pool and the staging buffers.

A decode node copies every chunk from its pinned receive pool to its GPU, and a prefill node
copies every chunk from its GPU into staging buffers: both cross the host's memory bus, and
across NUMA nodes that costs the QPI/UPI hop on every byte. ``connector.numa_node`` places
them (:func:`resolve`):

* ``auto`` - the NUMA node of the engine's GPU (its PCI device's ``numa_node`` in sysfs);
  without a GPU, the node that holds most of the engine's CPUs; nothing on a one-node host;
* ``none`` - the kernel's default (first touch);
* ``N`` - node N.

The pages of a buffer are then bound to that node (:func:`bind`: ``mbind`` with
``MPOL_PREFERRED`` and ``MPOL_MF_MOVE``) before they are touched or pinned. ``sysfs`` is a
parameter so a fake tree can stand in for a multi-socket host in tests.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from kvrelay.common.errors import ConfigError

log = logging.getLogger(__name__)
SYSFS = Path("/sys")
AUTO, NONE = "auto", "none"
MPOL_PREFERRED, MPOL_MF_MOVE = 1, 1 << 1
_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}   # the syscall's number per architecture


def check_setting(setting: str) -> str:
    """``setting`` if it is ``auto``, ``none`` or a node number; else ConfigError."""
    if setting in (AUTO, NONE) or setting.isdigit():
        return setting
    raise ConfigError(f"connector.numa_node {setting!r}: use auto, none or a NUMA node number")


def cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (sysfs's list format)."""
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def nodes(sysfs: Path = SYSFS) -> dict[int, set[int]]:
    """The host's NUMA nodes and their CPUs (empty where sysfs does not say)."""
    root = sysfs / "devices" / "system" / "node"
    out = {}
    for d in sorted(root.glob("node[0-9]*")):
        try:
            out[int(d.name[4:])] = cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return out


def gpu_node(pci_bus_id: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of the PCI device ``pci_bus_id`` (``0000:3b:00.0``; None if the firmware says -1)."""
    bus = pci_bus_id.strip().lower()
    if bus.count(":") == 1:
        bus = f"0000:{bus}"
    if len(bus.split(":")[0]) == 8:                  # nvidia-smi's 8-digit domain
        bus = bus[4:]
    try:
        node = int((sysfs / "bus" / "pci" / "devices" / bus / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def resolve(setting: str, *, pci_bus_id: str | None = None, cpus: Iterable[int] | None = None,
            sysfs: Path = SYSFS) -> int | None:
    """The NUMA node ``connector.numa_node`` means for an engine on GPU ``pci_bus_id`` (None: no
    GPU) whose threads may run on ``cpus`` (None: this process's); None = leave it to the kernel."""
    setting = check_setting(setting)
    known = nodes(sysfs)
    if setting == NONE:
        return None
    if setting.isdigit():
        if known and int(setting) not in known:
            raise ConfigError(f"connector.numa_node {setting}: this host's NUMA nodes are {sorted(known)}")
        return int(setting)
    if len(known) <= 1:
        return None                                   # one node: nothing to choose
    if pci_bus_id:
        return gpu_node(pci_bus_id, sysfs)
    mine = set(os.sched_getaffinity(0) if cpus is None else cpus)
    best = max(known, key=lambda n: (len(known[n] & mine), -n))
    return best if known[best] & mine else None


def bind(address: int, nbytes: int, node: int | None) -> bool:
    """Prefer NUMA node ``node`` for the pages of ``[address, address + nbytes)`` and move those
    already touched there. False (logged) where the kernel or the architecture does not allow it."""
    if node is None or nbytes <= 0:
        return False
    number = _MBIND.get(os.uname().machine)
    if number is None:
        log.warning("NUMA: no mbind on %s; buffers stay where the kernel puts them", os.uname().machine)
        return False
    mask = ctypes.c_ulong(1 << node) if node < 64 else None
    if mask is None:
        log.warning("NUMA: node %d is beyond the first 64; buffers stay where the kernel puts them", node)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(nbytes),
                      ctypes.c_int(MPOL_PREFERRED), ctypes.byref(mask), ctypes.c_ulong(64), ctypes.c_uint(MPOL_MF_MOVE))
    if rc != 0:
        log.warning("NUMA: mbind to node %d failed (%s); buffers stay where the kernel puts them", node,
                    os.strerror(ctypes.get_errno()))
        return False
    return True


def pages_on(address: int, nbytes: int, page: int = 4096) -> set[int]:
    """The NUMA nodes the (touched) pages of a buffer sit on (``move_pages`` query; empty if unknown)."""
    number = {"x86_64": 279, "aarch64": 239}.get(os.uname().machine)
    if number is None:
        return set()
    count = max(1, nbytes // page)
    pages = (ctypes.c_void_p * count)(*[address + i * page for i in range(count)])
    status = (ctypes.c_int * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_int(0), ctypes.c_ulong(count), pages, None, status,
                      ctypes.c_int(0))
    return {s for s in status if s >= 0} if rc == 0 else set()
