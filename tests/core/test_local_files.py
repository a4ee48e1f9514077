"""Another local user's files neither hang, blind nor steer a node (common/private_files.py, the
gauge snapshots of core/gauge_snapshots.py, the drain file of core/drain.py).

Real files, FIFOs and symlinks; "another user" is ``nobody`` (these tests run as root, so they
chown). Each reader runs in a thread with a deadline: before the fix a FIFO blocked it forever.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvrelay.common.errors import ConfigError
from kvrelay.common.private_files import read_small, runtime_dir, write_atomic
from kvrelay.core.drain import DrainPhase, read_phase
from kvrelay.core.gauge_snapshots import WorkerGauges, snapshot_path, summed

NOBODY = 65534
GAUGE = "kvrelay_pool_slots_busy"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plants other users' files: needs root")


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, failing the test if it takes longer than ``seconds`` (a blocked read)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"blocked for over {seconds} s (a FIFO read without O_NONBLOCK?)"
    return out[0]


def _plant(path: Path, kind: str, owner: int = NOBODY, text: str = "") -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/etc/passwd")
    else:
        path.write_text(text)
    os.lchown(path, owner, owner)


@pytest.fixture
def rundir(tmp_path: Path) -> Path:
    return runtime_dir(str(tmp_path / "run"))


def test_the_runtime_directory_is_private_or_refused(tmp_path: Path):
    d = runtime_dir(str(tmp_path / "run"))
    assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.geteuid()
    assert runtime_dir(str(d)) == d                        # already there: used as it is
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o1777)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    link = tmp_path / "link"
    link.symlink_to(d)
    for bad, why in ((open_dir, "open to other users"), (theirs, "owned by uid 65534"), (link, "symlink")):
        with pytest.raises(ConfigError, match=why):
            runtime_dir(str(bad))


@pytest.mark.parametrize("kind", ["fifo", "symlink", "theirs", "huge"])
def test_read_small_refuses_what_is_not_our_small_regular_file(tmp_path: Path, kind: str):
    p = tmp_path / "f"
    if kind == "huge":
        p.write_bytes(b"x" * 70_000)
    else:
        _plant(p, "fifo" if kind == "fifo" else "symlink" if kind == "symlink" else "file", text="stopping")
    assert _within(2, lambda: read_small(p)) is None
    write_atomic(tmp_path / "ours", b"draining\n")
    assert read_small(tmp_path / "ours") == b"draining\n"
    assert (tmp_path / "ours").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("kind", ["fifo", "symlink", "theirs"])
def test_a_planted_drain_file_neither_hangs_nor_drains_the_node(tmp_path: Path, kind: str):
    p = tmp_path / "decode0-8200.drain"
    _plant(p, "fifo" if kind == "fifo" else "symlink" if kind == "symlink" else "file", text="stopping")
    assert _within(2, lambda: read_phase(str(p))) is DrainPhase.SERVING
    os.unlink(p)
    p.write_text("stopping\n")                             # the supervisor's own (or root's) file counts
    assert read_phase(str(p)) is DrainPhase.STOPPING


def _snapshot(directory: Path, engine: str, pid: int, value: float) -> Path:
    p = snapshot_path(engine, pid, directory)
    write_atomic(p, json.dumps({GAUGE: [[{}, value]]}).encode())
    return p


def test_planted_gauge_files_neither_hang_blind_nor_forge_metrics(rundir: Path):
    """Beside a live worker's snapshot: a FIFO, a name that is not ``-<pid>.json``, garbage,
    a snapshot for pid 1 owned by another user, and files of dead workers of other engines."""
    _snapshot(rundir, "eng", os.getpid(), 3.0)
    _plant(rundir / "kvrelay-gauges-eng-1.json", "file", text=json.dumps({GAUGE: [[{}, 1000.0]]}))
    with subprocess.Popen(["sleep", "60"]) as live:   # a live pid of its own (our parent may be pid 1)
        try:
            os.mkfifo(rundir / f"kvrelay-gauges-eng-{live.pid}.json")
            (rundir / "kvrelay-gauges-eng-x.json").write_text("{}")
            (rundir / "kvrelay-gauges-eng-2.json").write_text("[not json")
            dead = [_snapshot(rundir, other, 4_000_000 + k, 9.0) for k, other in enumerate(("eng", "old-engine"))]
            total = _within(2, lambda: summed("eng", rundir))
            fams = _within(2, lambda: list(WorkerGauges("eng", ["engine"], ["0"], rundir).collect()))
        finally:
            live.kill()
    assert total == {(GAUGE, ()): 3.0}, total
    assert not any(p.exists() for p in dead), "dead workers' snapshots were left behind"
    busy = next(f for f in fams if f.name == GAUGE)
    assert [s.value for s in busy.samples] == [3.0]


def test_a_snapshot_of_the_wrong_shape_is_skipped_not_raised(rundir: Path):
    _snapshot(rundir, "eng", os.getpid(), 2.0)
    for k, text in enumerate(('{"kvrelay_pool_slots_busy": 5}', '{"kvrelay_pool_slots_busy": [[1, 2]]}', '"x"')):
        (rundir / f"kvrelay-gauges-eng-{os.getppid() + 0 * k}.json").write_text(text)
        assert summed("eng", rundir) == {(GAUGE, ()): 2.0}
