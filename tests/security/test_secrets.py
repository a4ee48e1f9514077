"""The shared secret: no default, never on a command line, refused when readable by others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import SECRET_ENV, load_secret, write_secret_file
from kvrelay.core import config as kcfg
from kvrelay.deploy import launch, node_files


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


def test_engines_get_a_view_without_client_keys_and_redis_urls_carry_no_password(tmp_path: Path):
    cfg = kcfg.from_dict({"router": {"api_keys": ["sk-yaml-1"], "api_keys_file": "/run/keys", "tls_key": "/k.pem",
                                     "decode": ["http://d:1=tcp://d:2"]},
                          "deploy": {"log_dir": str(tmp_path)}})
    for spec in launch.node_specs(cfg):
        cmd = " ".join(launch.server_command(cfg, spec))
        assert "sk-yaml-1" not in cmd and "/run/keys" not in cmd and "/k.pem" not in cmd
        seen = kcfg.from_connector_extra(launch.connector_config(cfg, spec)["kv_connector_extra_config"])
        assert kcfg.push_allowlist(seen) == ["tcp://d:2"]          # what P's allowlist needs stays
    with pytest.raises(ConfigError, match="store.redis_password_file"):
        kcfg.from_dict({"store": {"redis_url": "redis://:hunter2@r:6379/0"}})
    with pytest.raises(ConfigError, match="store.redis_password_file"):
        kcfg.from_dict({"store": {"redis_url": "rediss://user:hunter2@r:6379/0"}})
    assert kcfg.from_dict({"store": {"redis_url": "redis://user@r:6379/0"}}).store.redis_url   # a user is fine
    env = launch.server_env(cfg, 0, 2) if "KVRELAY_API_KEY" not in os.environ else {}
    assert "KVRELAY_API_KEY" not in env


def test_serve_dry_run_shows_no_client_key(tmp_path: Path):
    conf = tmp_path / "kvrelay.yaml"
    conf.write_text("router:\n  api_keys: [sk-yaml-dry]\n")
    env = {**os.environ, "KVRELAY_API_KEY": "sk-env-dry"}
    for role in ("prefill", "decode"):
        r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--config", str(conf), "--role", role,
                            "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-800:]
        assert "--kv-transfer-config" in r.stdout
        assert "sk-yaml-dry" not in r.stdout + r.stderr and "sk-env-dry" not in r.stdout + r.stderr


def _proc_texts(name: str) -> dict[int, bytes]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = (d / name).read_bytes()
            except OSError:               # gone, or not ours
                continue
    return out


def _descendants(pid: int) -> set[int]:
    kids = {pid}
    for p, stat in _proc_texts("stat").items():
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) in kids:
            kids.add(p)
    return kids


def _local_sockets(where: Path) -> set[Path]:
    """The Unix socket files directly in ``where``."""
    return {p for p in where.iterdir() if p.is_socket()} if where.is_dir() else set()


@pytest.mark.slow
def test_a_running_stack_shows_no_secret_on_a_command_line_or_in_a_log(tiny_model: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """Keys in the YAML, in a keys file and in KVRELAY_API_KEY, a Redis password file and the
    shared secret: each works, and none is on any process's command line, in any log, in a
    world-readable file, or in an engine's environment (the client keys). The engines' local
    sockets (vLLM's and the store lookup's) are in each node's private directory, not in the
    shared temporary one, and none is left once the stack has stopped."""
    import urllib.error
    import urllib.request

    from kvrelay.bench.local_redis import REDIS, redis_server
    from tests.e2e.harness import start_stack
    if REDIS is None:
        pytest.skip("redis-server not installed (deploy/setup.sh installs it)")
    yaml_key, file_key, env_key, redis_pw = (f"sk-{w}-{os.urandom(6).hex()}" for w in ("yaml", "file", "env", "redis"))
    keys_file = write_secret_file(tmp_path / "keys", file_key)
    pw_file = write_secret_file(tmp_path / "redis-pw", redis_pw)
    monkeypatch.setenv("KVRELAY_API_KEY", env_key)
    secrets = [yaml_key, file_key, env_key, redis_pw, os.environ[SECRET_ENV]]
    (tmp_path / "redis").mkdir()
    shared_before = _local_sockets(Path(tempfile.gettempdir()))
    with redis_server(tmp_path / "redis", password=redis_pw) as (url, _):
        handle = start_stack(tiny_model, tmp_path / "stack", 21300, transport__backend="tcp",
                             router__api_keys=[yaml_key], router__api_keys_file=str(keys_file),
                             store__enabled=True, store__redis_url=url, store__redis_password_file=str(pw_file),
                             store__save_decoded=True)
        try:
            def post(key: str) -> int:
                body = json.dumps({"model": "kvrelay-tiny", "prompt": "hello " * 40, "max_tokens": 4}).encode()
                req = urllib.request.Request(f"{handle.router_url}/v1/completions", data=body, headers={
                    "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        return r.status
                except urllib.error.HTTPError as exc:
                    return exc.code
            assert [post(k) for k in (yaml_key, file_key, env_key, "")] == [200, 200, 200, 401]
            for pid, cmdline in _proc_texts("cmdline").items():
                for s in secrets:
                    assert s.encode() not in cmdline, f"a secret on the command line of pid {pid}"
            stack_dir = tmp_path / "stack"
            for f in stack_dir.rglob("*"):
                if f.is_file():
                    text = f.read_bytes()
                    if any(s.encode() in text for s in secrets):
                        assert f.stat().st_mode & 0o077 == 0, f"{f} holds a secret and others can read it"
                        assert f.suffix != ".log", f"a secret in the log {f}"
            assert yaml_key not in (stack_dir / "logs" / "nodes.yaml").read_text()
            engines = set().union(*(_descendants(p.pid) for n, p in handle.stack.procs.items() if n != "router"))
            environs = _proc_texts("environ")
            for pid in engines & set(environs):
                assert env_key.encode() not in environs[pid], f"the client key in engine pid {pid}'s environment"
            ipc_dirs = [node_files.ipc_dir(handle.stack.cfg, s) for s in handle.stack.specs]
            assert all(_local_sockets(d) for d in ipc_dirs), "vLLM's sockets are in each node's own directory"
            assert any(p.name.startswith("kvrelay-store-") for d in ipc_dirs for p in _local_sockets(d))
        finally:
            handle.stack.stop()
    # nothing left in the shared temporary directory, and the nodes' directories are gone
    assert _local_sockets(Path(tempfile.gettempdir())) - shared_before == set()
    assert not any(d.exists() for d in ipc_dirs)
