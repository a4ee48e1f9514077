"""Operator commands given a bad argument or an unreachable server say what is wrong in one line
(exit status 2), never with a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvrelay.cli import main


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                    # nothing listens there now
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("argv, says", [
    (["deploy", "k8s", "--out", "OUT", "--gpus-per-pod", "0"], "--gpus-per-pod must be at least 1"),
    (["deploy", "k8s", "--out", "OUT", "--secret-file", "/nonexistent/secret"],
     "--secret-file: cannot read /nonexistent/secret"),
    (["warmup", "--prompts", "/nonexistent/prompts.txt"], "--prompts: cannot read"),
    (["warmup", "--prompts", "PROMPTS", "--url", "DEAD"], "DEAD"),
    (["dashboard", "--prometheus", "DEAD", "--out", "OUT"], "Prometheus at DEAD did not answer"),
    (["config", "--router.decode", "foo"], "router.decode: 'foo' is not a node"),
    (["config", "--transport.backend", "carrier-pigeon"], "valid values: nixl, tcp, shm, ucx"),
])
def test_a_bad_argument_or_a_dead_server_is_one_clear_line(argv, says, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("hello there\n")
    dead = _dead_url()
    subst = {"PROMPTS": str(tmp_path / "prompts.txt"), "DEAD": dead, "OUT": str(tmp_path / "d.png")}
    argv = [subst.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("kvrelay: ")   # after a progress bar
    assert subst.get(says, says.replace("DEAD", dead)) in err, err
