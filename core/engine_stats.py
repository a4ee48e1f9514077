"""The connectors' metrics on the engine's own ``/metrics``, through vLLM's KV-connector stats hooks.

How they travel (vLLM v1):

1. *Worker process*, once per engine step: ``get_kv_connector_stats()`` returns a
   :class:`RelayStats` with what changed in this process's :class:`kvrelay.core.telemetry.Metrics`
   since the last call - counter increments, gauge values, histogram observations
   (:meth:`StatsTracker.delta`, at most every 0.5 s, and in the step that reports a finished
   transfer). Nothing changed: None.
2. *EngineCore*: vLLM attaches the payload (``to_dict()``) to the step's scheduler stats.
3. *API server* (the front end that serves ``/metrics``): vLLM builds the stats with
   ``build_kv_connector_stats(data)`` (:meth:`RelayStats.aggregate` concatenates intervals)
   and hands them to ``build_prom_metrics(...).observe(data)``: :class:`RelayPromMetrics`
   applies them to the same :class:`~kvrelay.core.telemetry.Metrics` families in that process, so
   the series appear under the same names, types and labels as on the worker's own
   exporter (``connector.metrics_port``).

Counters and histograms move only while the engine steps: a count that grows while it idles (a
late refusal) shows up with the next step. Gauges are read from the workers at scrape time
instead (:mod:`kvrelay.core.gauge_snapshots`), so an idle node's pool reads what it holds.
On the API server every series carries vLLM's own labels (``model_name``, ``engine``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvrelay.common.private_files import runtime_dir
from kvrelay.core.config import from_connector_extra
from kvrelay.core.gauge_snapshots import WorkerGauges
from kvrelay.core.telemetry import Metrics, has_metrics, labelled_metrics, metrics


@dataclass
class RelayStats(KVConnectorStats):
    """``data``: {"inc": [[family, labels, delta]], "set": [[family, labels, value]],
    "obs": [[family, [values]]]} - plain lists, as vLLM ships them between processes."""

    data: dict[str, Any] = field(default_factory=lambda: {"inc": [], "set": [], "obs": []})

    def reset(self) -> None:
        self.data = {"inc": [], "set": [], "obs": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in ("inc", "set", "obs"):
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: every counter's increase over the interval."""
        out: dict[str, int | float] = {}
        for family, labels, delta in self.data.get("inc", []):
            name = family + "".join(f",{k}={v}" for k, v in sorted(labels.items()))
            out[name] = out.get(name, 0) + delta
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("inc", "set", "obs"))


def families(m: Metrics) -> dict[str, Any]:
    """Family name -> metric object of ``m`` (counters by their name without ``_total``)."""
    from prometheus_client.metrics import MetricWrapperBase

    out = {}
    for value in vars(m).values():
        metric = getattr(value, "histogram", None) or getattr(value, "counter", None) or value
        if isinstance(metric, MetricWrapperBase):
            out[metric._name] = value
    return out


class StatsTracker:
    """Worker side: what changed in ``m`` since the previous :meth:`delta`.

    Reading every family costs about 1-2 ms, too much for every engine step, so a delta is
    taken at most every ``interval_s`` - or at once when ``force`` (the step that reports a
    finished transfer, so a request's numbers are on ``/metrics`` when it completes)."""

    def __init__(self, m: Metrics, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.families, self.interval_s, self.clock = families(m), interval_s, clock   # fixed once built
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._taken = float("-inf")

    def delta(self, force: bool = False) -> RelayStats | None:
        now = self.clock()
        if not force and now - self._taken < self.interval_s:
            return None
        self._taken = now
        stats = RelayStats()
        for name, metric in self.families.items():
            if hasattr(metric, "drain"):                  # a recorded histogram: its observations
                values = metric.drain()
                if values:
                    stats.data["obs"].append([name, values])
                continue
            for fam in metric.collect():
                for s in fam.samples:
                    if fam.type == "counter" and s.name.endswith("_total"):
                        key = (name, tuple(sorted(s.labels.items())))
                        inc = s.value - self._last.get(key, 0.0)
                        self._last[key] = s.value
                        if inc:
                            stats.data["inc"].append([name, dict(s.labels), inc])
                    elif fam.type == "gauge":
                        key = (name, tuple(sorted(s.labels.items())))
                        if self._last.get(key) != s.value:
                            self._last[key] = s.value
                            stats.data["set"].append([name, dict(s.labels), s.value])
        return None if stats.is_empty() else stats


class RelayPromMetrics(KVConnectorPromMetrics):
    """API-server side: apply the workers' changes to this process's metric families, under
    vLLM's labels; serve the workers' gauges at scrape time."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.engine_labels = {i: dict(zip(labelnames, map(str, v), strict=True))
                              for i, v in per_engine_labelvalues.items()}
        if has_metrics():                   # the engine runs in this process: its worker set is here already
            self.families, self.engine_labels = families(metrics()), {}
            return
        self.families = families(labelled_metrics(tuple(labelnames)))
        engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
        if engine_id:
            cfg = from_connector_extra(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
            _register_gauges(str(engine_id), tuple(labelnames), tuple(per_engine_labelvalues.get(0, ())),
                             str(runtime_dir(cfg.connector.runtime_dir)))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        fams, lab = self.families, self.engine_labels.get(engine_idx, {})
        for name, labels, inc in transfer_stats_data.get("inc", []):
            if name in fams:
                (fams[name].labels(**lab, **labels) if lab or labels else fams[name]).inc(inc)
        for name, labels, value in transfer_stats_data.get("set", []):
            if name in fams:                # in-process engines only: otherwise gauges come from the snapshots
                (fams[name].labels(**labels) if labels else fams[name]).set(value)
        for name, values in transfer_stats_data.get("obs", []):
            if name in fams:
                target = fams[name].labels(**lab) if lab else fams[name]
                for v in values:
                    target.observe(v)


@functools.cache
def _register_gauges(engine_id: str, labelnames: tuple[str, ...], labelvalues: tuple[object, ...],
                     directory: str) -> None:
    from prometheus_client import REGISTRY

    REGISTRY.register(WorkerGauges(engine_id, labelnames, labelvalues, Path(directory)))
