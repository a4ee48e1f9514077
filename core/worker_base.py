"""The worker half both connectors share: engine geometry, event log, metrics, and the
finished/error hand-off to vLLM. It imports nothing of vLLM.

vLLM reaches a worker half only through a thin adapter: the ``vllm_config`` it reads (the
cache's block size, the model, the TP rank and size, the KV heads, the engine id) and the KV
caches it registers. The connectors (:mod:`kvrelay.core.connector_base`) pass vLLM's own; the
GPU check (``tests/gpu``) passes one that lays out GPU tensors as vLLM does, on a machine
without vLLM.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Protocol

import torch

from kvrelay.common import numa
from kvrelay.common.private_files import runtime_dir
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.fingerprint import engine_fingerprint
from kvrelay.core.gauge_snapshots import SnapshotWriter, read_gauges, snapshot_path
from kvrelay.core.hooks import InspectHook, load_function
from kvrelay.core.params import ParamsError
from kvrelay.core.rank_view import RankView
from kvrelay.core.telemetry import EventLog, metrics
from kvrelay.core.tracing import TransferSpans
from kvrelay.kernels.layout import KVLayout

log = logging.getLogger(__name__)


def pci_bus_id(device: torch.device) -> str | None:
    """The PCI address (``0000:3b:00.0``) of CUDA device ``device``; None for the CPU or where torch does not say."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    domain, bus, dev = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    if bus is None or dev is None:
        return None
    return f"{domain or 0:04x}:{bus:02x}:{dev:02x}.0"


class WorkerHalf(Protocol):
    """The worker half (model-runner process); see :class:`WorkerBase`."""

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def take_finished(self) -> set[str]: ...

    def take_errors(self) -> set[int]: ...

    def wait_for_progress(self, timeout: float) -> None: ...

    def close(self) -> None: ...


class WorkerBase:
    """Engine geometry, event log, metrics and the finished/error hand-off to vLLM."""

    role = "worker"

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.block_size: int = vllm_config.cache_config.block_size
        if cfg.chunk_tokens % self.block_size:
            raise ParamsError(f"chunk_tokens={cfg.chunk_tokens} must be a multiple of the engine "
                              f"block size {self.block_size}")
        self.blocks_per_chunk = cfg.chunk_tokens // self.block_size
        self.layout: KVLayout | None = None
        self.fingerprint: Any = None
        self.ranks: RankView | None = None       # this rank's heads and pieces (set at register)
        self.inspect: InspectHook | None = load_function(cfg.connector.inspect_hook, "connector.inspect_hook")
        self.transfer_digest = b""               # what a peer rank's Hello must match
        self.numa_node: int | None = None        # where the host buffers live (common/numa.py)
        self.events = EventLog(cfg.connector.events_path, f"{self.role}-{os.getpid()}")
        self.metrics = metrics(cfg.connector.metrics_port, cfg.connector.metrics_host)
        self.metrics.events_dropped.bind(lambda: self.events.dropped)
        engine_id = str(getattr(getattr(vllm_config, "kv_transfer_config", None), "engine_id", "") or os.getpid())
        self.gauges = SnapshotWriter(functools.partial(read_gauges, self.metrics),    # ... its gauges, also idle
                                     snapshot_path(engine_id, os.getpid(), runtime_dir(cfg.connector.runtime_dir))).start()
        self.spans = TransferSpans(cfg.tracing.endpoint, cfg.tracing.protocol, f"kvrelay-{self.role}")
        self._lock = threading.Condition()
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._progress = threading.Event()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = KVLayout.from_caches(kv_caches)
        self.fingerprint = engine_fingerprint(self.vllm_config, self.layout, self.cfg)
        self.ranks = RankView.of(self.vllm_config, self.layout, self.cfg, self.role)
        self.transfer_digest = self.ranks.transfer_fingerprint(self.fingerprint, self.layout).digest()
        self.numa_node = numa.resolve(self.cfg.connector.numa_node, pci_bus_id=pci_bus_id(self.layout.device))
        if self.numa_node is not None:
            log.info("kvrelay %s: host buffers on NUMA node %d (connector.numa_node %s)", self.role, self.numa_node,
                     self.cfg.connector.numa_node)

    def blocks_in_chunk(self, prompt_len: int, c: int) -> int:
        """Engine blocks chunk ``c`` of a ``prompt_len``-token prompt spans (the tail may be short)."""
        tokens = min(self.cfg.chunk_tokens, prompt_len - c * self.cfg.chunk_tokens)
        return -(-tokens // self.block_size)

    def chunk_block_ids(self, block_ids: list[int], prompt_len: int, c: int) -> list[int]:
        """The request's engine block ids that hold chunk ``c``."""
        first = c * self.blocks_per_chunk
        return block_ids[first:first + self.blocks_in_chunk(prompt_len, c)]

    def busy(self) -> bool:
        """Transfers in flight (the subclass says which)."""
        return False

    def settled(self, req_id: str, failed_blocks: set[int] = frozenset(),  # type: ignore[assignment]
                finished: bool = True) -> None:
        """Report a request's failed blocks, and (``finished``: a background transfer) the request
        itself, to vLLM at the next ``get_finished`` (any thread)."""
        with self._lock:
            self._errors |= failed_blocks
            if finished:
                self._finished.add(req_id)
            self._progress.set()

    def take_finished(self) -> set[str]:
        with self._lock:
            done, self._finished = self._finished, set()
            self._progress.clear()
        return done

    def take_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        return errs

    def wait_for_progress(self, timeout: float) -> None:
        """Block up to ``timeout`` while transfers are in flight and none has settled."""
        if self.busy() and not self._finished:
            self._progress.wait(timeout)

    def close(self) -> None:
        """Stop what the base started (the gauge snapshots); subclasses call it last."""
        self.gauges.close()
