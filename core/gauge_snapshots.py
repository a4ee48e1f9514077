"""Worker gauges on the engine's ``/metrics`` while the engine idles.

vLLM moves a connector's numbers to the API server only inside engine steps
(:mod:`kvrelay.core.engine_stats`), and an idle engine does not step: slots freed after the last
step (an aborted request's) would read busy until the next request. So the gauges take another
road. Each worker process writes its :data:`~kvrelay.core.telemetry.GAUGES` to a small JSON file
when they change (checked every ``interval_s``, 1 s: reading the pool's occupancy walks its
slots), named by the engine's ``engine_id`` (the same in the API server and its workers) and
the worker's pid; the API server's collector reads the
files of its engine at scrape time and sums them across workers (tensor-parallel ranks). A file
whose worker has died is removed, not summed, whichever engine it was of.

The files live in the node's private runtime directory (``connector.runtime_dir``,
:mod:`kvrelay.common.private_files`), and the reader trusts none of them anyway: a name that is
not exactly ``kvrelay-gauges-<engine>-<pid>.json`` is skipped, a file is read without blocking
(a FIFO is refused) and only if it is a regular file of ours under 64 KiB, and content that is
not the snapshot's shape is skipped. ``/metrics`` never waits on, or fails because of, a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrelay.common.private_files import read_small, write_atomic
from kvrelay.core.telemetry import GAUGES, Metrics

Values = dict[str, list[tuple[dict[str, str], float]]]      # gauge name -> [(own labels, value)]
_NAME = re.compile(r"kvrelay-gauges-(?P<engine>[\w.-]+)-(?P<pid>[1-9][0-9]{0,9})\.json")


def _safe(engine_id: str) -> str:
    return re.sub(r"[^\w.-]", "_", engine_id)


def snapshot_path(engine_id: str, pid: int, directory: Path) -> Path:
    """Worker ``pid``'s file for ``engine_id`` in ``directory`` (the node's runtime directory)."""
    return directory / f"kvrelay-gauges-{_safe(engine_id)}-{pid}.json"


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
        with contextlib.suppress(OSError):                  # a full /dev/shm costs a stale gauge, nothing more
            write_atomic(self.path, text.encode())
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


def _samples(data: bytes) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """A snapshot's samples, or none when it is not a snapshot's shape."""
    try:
        values = json.loads(data)
        return [(name, tuple(sorted((str(k), str(v)) for k, v in labels.items())), float(value))
                for name, samples in values.items() if name in GAUGES for labels, value in samples]
    except (ValueError, TypeError, AttributeError):
        return []


def summed(engine_id: str, directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every live worker's gauges for ``engine_id``, summed: {(name, own labels): value}.
    Files of dead workers (of any engine) are removed on the way."""
    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    want = _safe(engine_id)
    try:
        names = os.listdir(directory)
    except OSError:
        return total
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        pid = int(m["pid"])
        if not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
            continue
        data = read_small(directory / name, owners=(os.geteuid(),)) if m["engine"] == want else None
        for key_name, labels, value in _samples(data) if data else ():
            key = (key_name, labels)
            total[key] = total.get(key, 0.0) + value
    return total


class WorkerGauges:
    """API-server side: a Prometheus collector serving the workers' gauges of one engine at
    scrape time, with vLLM's labels (``labelnames`` = ``labelvalues``) before their own."""

    def __init__(self, engine_id: str, labelnames: Sequence[str], labelvalues: Sequence[object],
                 directory: Path) -> None:
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
