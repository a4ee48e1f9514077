"""Worker gauges on the engine's ``/metrics`` while the engine idles.

vLLM moves a connector's numbers to the API server only inside engine steps
(:mod:`kvrelay.core.engine_stats`), and an idle engine does not step: slots freed after the last
step (an aborted request's) would read busy until the next request. So the gauges take another
road. Each worker process writes its :data:`~kvrelay.core.telemetry.GAUGES` to a small JSON file
when they change (checked every ``interval_s``, 1 s: reading the pool's occupancy walks its
slots), named by the engine's ``engine_id`` (the same in the API server and its workers) and
the worker's pid; the API server's collector reads the
files of its engine at scrape time and sums them across workers (tensor-parallel ranks). A file
whose worker has died is removed, not summed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrelay.core.telemetry import GAUGES, Metrics

SNAPSHOT_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
Values = dict[str, list[tuple[dict[str, str], float]]]      # gauge name -> [(own labels, value)]


def snapshot_path(engine_id: str, pid: int | str, directory: Path = SNAPSHOT_DIR) -> Path:
    """Worker ``pid``'s file for ``engine_id`` (``pid`` "*": the glob of every worker's)."""
    safe = re.sub(r"[^\w.-]", "_", engine_id)
    return directory / f"kvrelay-gauges-{safe}-{pid}.json"


def read_gauges(m: Metrics) -> Values:
    """The current value of every gauge of ``m`` (set_function gauges are evaluated now)."""
    out: Values = {}
    for gauge in m.gauges.values():
        for fam in gauge.collect():
            out[fam.name] = [(dict(s.labels), s.value) for s in fam.samples]
    return out


class SnapshotWriter:
    """Worker side: write this process's gauges to its snapshot file whenever they change."""

    def __init__(self, read: Callable[[], Values], path: Path, interval_s: float = 1.0) -> None:
        self.read, self.path, self.interval_s = read, path, interval_s
        self._last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvrelay-gauges", daemon=True)

    def start(self) -> SnapshotWriter:
        self._thread.start()
        return self

    def write_if_changed(self) -> bool:
        text = json.dumps(self.read(), sort_keys=True)
        if text == self._last:
            return False
        tmp = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):                  # a full /dev/shm costs a stale gauge, nothing more
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._last = text
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_if_changed()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        with contextlib.suppress(OSError):
            self.path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def summed(engine_id: str, directory: Path = SNAPSHOT_DIR) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every live worker's gauges for ``engine_id``, summed: {(name, own labels): value}."""
    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for path in directory.glob(snapshot_path(engine_id, "*", directory).name):
        pid = int(path.stem.rsplit("-", 1)[1])
        if not _alive(pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for name, samples in values.items():
            for labels, value in samples:
                key = (name, tuple(sorted(labels.items())))
                total[key] = total.get(key, 0.0) + float(value)
    return total


class WorkerGauges:
    """API-server side: a Prometheus collector serving the workers' gauges of one engine at
    scrape time, with vLLM's labels (``labelnames`` = ``labelvalues``) before their own."""

    def __init__(self, engine_id: str, labelnames: Sequence[str], labelvalues: Sequence[object],
                 directory: Path = SNAPSHOT_DIR) -> None:
        self.engine_id, self.directory = engine_id, directory
        self.labelnames, self.labelvalues = list(labelnames), [str(v) for v in labelvalues]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        values = summed(self.engine_id, self.directory)
        for name, (doc, own) in GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=[*self.labelnames, *own])
            keys = [k for k in values if k[0] == name] or ([(name, ())] if not own else [])
            for key in keys:
                labels = dict(key[1])
                fam.add_metric([*self.labelvalues, *(labels.get(o, "") for o in own)], values.get(key, 0.0))
            yield fam

    def describe(self) -> list[Any]:
        return []
