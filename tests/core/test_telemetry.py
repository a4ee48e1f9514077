"""The event log on a real full filesystem (a 16 KiB tmpfs) and its rotation (hardening, failure mode 8)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvrelay.core.telemetry import EventLog, read_events
from tests.conftest import mount_small_fs


@pytest.fixture
def small_fs(tmp_path: Path):
    with mount_small_fs(tmp_path / "small", "16k") as d:
        yield d


def test_full_disk_drops_lines_and_never_raises(small_fs: Path):
    path = small_fs / "events.jsonl"
    events = EventLog(str(path), "prefill-test")
    errors: list[BaseException] = []

    def writer() -> None:                       # like the push thread: write, and write again on error
        try:
            for i in range(400):
                try:
                    events.write("push_done", chunk=i, pad="x" * 200)
                except Exception as exc:
                    events.write("push_failed", reason=str(exc))
                    raise
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    t.join(30)
    assert not errors and not t.is_alive()
    assert events.dropped > 0, "the 16 KiB filesystem never filled up"
    kept = read_events(path)                         # a line torn by the full disk is skipped, not fatal
    assert kept and all(ev["event"] == "push_done" for ev in kept)
    assert len(path.read_text().splitlines()) - len(kept) <= 1
    path.unlink()                                                        # space comes back: logging resumes
    before = events.dropped
    events.write("push_done", chunk=999)
    assert events.dropped == before and json.loads(path.read_text())["chunk"] == 999


def test_rotates_past_max_bytes(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    events = EventLog(str(path), "decode-test", max_bytes=4096)
    for i in range(200):
        events.write("install", chunk=i)
    rotated = tmp_path / "events.jsonl.1"
    assert rotated.exists() and path.stat().st_size <= 4096 + 200
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["chunk"] == 199 and events.dropped == 0


def test_unwritable_path_is_counted():
    events = EventLog("/nonexistent-dir/kvrelay/events.jsonl", "x")
    events.write("a")
    events.write("b")
    assert events.dropped == 2
