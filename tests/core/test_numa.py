"""NUMA placement of the host buffers (common/numa.py): the node ``connector.numa_node`` means,
read from a fake two-socket sysfs tree, and real ``mbind`` of real buffers on this host."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.common import numa
from kvrelay.common.errors import ConfigError
from kvrelay.core import config as kcfg
from kvrelay.prefill.staging import StagingPool
from kvrelay.transport.pool import Placement, ReceivePool

ROOT = Path(__file__).resolve().parents[2]


def _sysfs(tmp: Path, cpus: dict[int, str], gpus: dict[str, str]) -> Path:
    """A sysfs tree with NUMA nodes ``{node: cpulist}`` and PCI devices ``{bus id: numa_node}``."""
    for node, cpulist in cpus.items():
        d = tmp / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for bus, node in gpus.items():
        d = tmp / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return tmp


def test_auto_is_the_gpus_node_else_the_node_of_the_engines_cpus(tmp_path: Path):
    two = _sysfs(tmp_path / "two", {0: "0-3,8-11", 1: "4-7,12-15"}, {"0000:3b:00.0": "0", "0000:af:00.0": "1",
                                                                      "0000:c1:00.0": "-1"})
    assert numa.resolve("auto", pci_bus_id="0000:af:00.0", sysfs=two) == 1
    assert numa.resolve("auto", pci_bus_id="00000000:3B:00.0", sysfs=two) == 0     # nvidia-smi's spelling
    assert numa.resolve("auto", pci_bus_id="0000:c1:00.0", sysfs=two) is None      # the firmware does not say
    assert numa.resolve("auto", cpus={5, 6, 12}, sysfs=two) == 1
    assert numa.resolve("auto", cpus={2, 4, 9}, sysfs=two) == 0                      # most of its CPUs
    assert numa.resolve("none", cpus={5}, sysfs=two) is None
    assert numa.resolve("1", sysfs=two) == 1
    with pytest.raises(ConfigError, match="NUMA nodes are \\[0, 1\\]"):
        numa.resolve("3", sysfs=two)
    one = _sysfs(tmp_path / "one", {0: "0-15"}, {"0000:3b:00.0": "0"})
    assert numa.resolve("auto", pci_bus_id="0000:3b:00.0", sysfs=one) is None       # one node: nothing to choose
    assert numa.cpulist("0-2,7,9-10") == {0, 1, 2, 7, 9, 10}


def test_a_setting_that_is_no_node_is_refused_at_load():
    with pytest.raises(ConfigError, match="connector.numa_node 'socket1'"):
        kcfg.load(overrides=["connector.numa_node=socket1"])
    assert kcfg.load(overrides=["connector.numa_node=0"]).connector.numa_node == "0"


@pytest.mark.skipif(not numa.nodes(), reason="sysfs lists no NUMA node")
def test_buffers_are_bound_to_the_node_before_their_pages_exist():
    node = min(numa.nodes())
    buf = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert numa.bind(address, 1 << 20, node)
    view[:] = b"\x01" * (1 << 20)                                   # touch every page
    assert numa.pages_on(address, 1 << 20) == {node}
    del view
    buf.close()
    pool = ReceivePool(4 << 20, 1 << 20, placement=Placement(numa_node=node), pin=False)
    assert pool.numa_node == node and numa.pages_on(pool.arena.address, 4 << 20) <= {node}
    pool.close()
    staged = StagingPool(1 << 20, 2, numa_node=node).take((1, 1, 1 << 20))
    assert staged.slot is not None and numa.pages_on(staged.slot.data_ptr(), 1 << 20) == {node}


def test_serve_dry_run_prints_the_node():
    res = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", "decode", "--dry-run",
                          "--connector.numa-node", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr
    assert "kvrelay: decode0: NUMA node 0 (as set; connector.numa_node 0)" in res.stderr, res.stderr
