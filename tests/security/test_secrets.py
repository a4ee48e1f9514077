"""The shared secret: no default, never on a command line, refused when readable by others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import SECRET_ENV, load_secret, write_secret_file
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch


def env_without_secret() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def test_no_secret_no_start_and_the_message_says_how():
    cfg = kcfg.from_dict({})
    with pytest.raises(ConfigError) as err:
        load_secret(cfg.transport, env_without_secret())
    assert SECRET_ENV in str(err.value) and "secret_file" in str(err.value)
    for role in ("prefill", "decode"):
        r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--role", role, "--dry-run"],
                           env=env_without_secret(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and SECRET_ENV in r.stderr, (r.returncode, r.stderr[-500:])
    with pytest.raises(ConfigError, match="shared_secret"):        # the old key says where the secret went
        kcfg.from_dict({"transport": {"shared_secret": "x" * 20}})


def test_secret_file_must_be_private(tmp_path: Path):
    path = write_secret_file(tmp_path / "secret")
    assert (path.stat().st_mode & 0o777) == 0o600
    cfg = kcfg.from_dict({"transport": {"secret_file": str(path)}})
    assert load_secret(cfg.transport, env_without_secret()) == path.read_text().strip().encode()
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(cfg.transport, env_without_secret())
    short = tmp_path / "short"
    short.write_text("tiny")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="shorter"):
        load_secret(kcfg.from_dict({"transport": {"secret_file": str(short)}}).transport, env_without_secret())


def test_kvrelay_up_makes_a_secret_per_stack_and_passes_it_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SECRET_ENV)
    cfg = kcfg.from_dict({"deploy": {"log_dir": str(tmp_path / "logs")}, "engine": {"model": "/models/x"}})
    stack = launch.Stack(cfg)
    stack.ensure_secret()
    path = Path(stack.cfg.transport.secret_file)
    secret = path.read_text().strip()
    assert (path.stat().st_mode & 0o777) == 0o600 and len(secret) >= 32
    for spec in stack.specs:
        cmd = " ".join(launch.server_command(stack.cfg, spec))
        assert secret not in cmd and str(path) in cmd
        assert "--middleware kvrelay.core.guard.kvrelay_guard" in cmd
    other = launch.Stack(kcfg.from_dict({"deploy": {"log_dir": str(tmp_path / "logs2")}}))
    other.ensure_secret()
    assert Path(other.cfg.transport.secret_file).read_text().strip() != secret    # one per stack
