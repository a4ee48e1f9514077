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
    (["deploy", "k8s", "--out", "OUT", "--gpus-per-pod", "-1"], "--prefill-gpus must be at least 0"),
    (["deploy", "k8s", "--out", "OUT", "--toleration", "gpu"], "--toleration 'gpu': expected"),
    (["deploy", "k8s", "--out", "OUT", "--secret-file", "/nonexistent/secret"],
     "--secret-file: cannot read /nonexistent/secret"),
    (["warmup", "--prompts", "/nonexistent/prompts.txt"], "--prompts: cannot read"),
    (["warmup", "--prompts", "PROMPTS", "--url", "DEAD"], "DEAD"),
    (["dashboard", "--prometheus", "DEAD", "--out", "OUT"], "Prometheus at DEAD did not answer"),
    (["config", "--router.decode", "foo"], "router.decode: 'foo' is not a node"),
    (["config", "--transport.backend", "carrier-pigeon"], "valid values: nixl, tcp, shm, ucx"),
    (["config", "--config", "TYPO_YAML"], "unknown field `pool_byte` - at `transport`; did you mean `pool_bytes`?"),
    (["router", "--router.prefill", "http://127.0.0.1:1", "--router.decode", "http://127.0.0.1:2=tcp://127.0.0.1:3",
      "--router.tls-cert", "/nonexistent.pem"], "router.tls_cert and router.tls_key must be set together"),
    (["router"], "router.prefill and router.decode must list at least one node each"),
    (["config", "--engine.decode-args=--tensor-parallel-size 2"], "set the tensor-parallel size with engine.prefill_tp"),
    (["config", "--engine.decode-args=--pipeline-parallel-size 2"], "pipeline and data parallelism are not supported"),
    (["config", "--store.cpu-bytes", "-1"], "size must be >= 0, got -1 - at `store.cpu_bytes`"),
    (["config", "--chunk-tokens", "100"], "chunk_tokens 100 is not a multiple of the engines' block size 16"),
    (["config", "--check", "--engine.model", "TINY", "--transport.pool-bytes", "4"],
     "transport.pool_bytes=4 cannot hold one prompt of max_model_len=4096"),
])
def test_a_bad_argument_or_a_dead_server_is_one_clear_line(argv, says, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("hello there\n")
    (tmp_path / "typo.yaml").write_text("transport:\n  pool_byte: 1GiB\n")
    monkeypatch.setenv("KVRELAY_SECRET", "x" * 32)
    dead = _dead_url()
    subst = {"PROMPTS": str(tmp_path / "prompts.txt"), "TYPO_YAML": str(tmp_path / "typo.yaml"), "DEAD": dead, "OUT": str(tmp_path / "d.png")}
    if "TINY" in argv:
        from kvrelay.deploy.tiny_model import make_tiny_model

        subst["TINY"] = str(make_tiny_model(tmp_path / "tiny"))
    argv = [subst.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("kvrelay: ")   # after a progress bar
    assert subst.get(says, says.replace("DEAD", dead)) in err, err


def test_a_mistyped_flag_is_refused_with_a_suggestion(capsys):
    """argparse would take ``--transport.pool_byte`` as an abbreviation of ``--transport.pool_bytes``."""
    with pytest.raises(SystemExit) as exc:
        main(["config", "--transport.pool_byte", "1GiB"])
    assert exc.value.code == 2
    assert "did you mean --transport.pool_bytes?" in capsys.readouterr().err


def test_config_check_lists_every_problem_the_router_and_up_would_refuse(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.delenv("KVRELAY_SECRET", raising=False)
    assert main(["config", "--check"]) == 0                      # kvrelay up makes its own secret
    assert "config OK" in capsys.readouterr().err
    argv = ["config", "--check", "--router.prefill", "http://a:8100", "--router.policy", "cache_aware",
            "--router.api-keys-file", "/nonexistent/keys"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for says in ("router.prefill and router.decode must list", "no shared secret", "router.api_keys_file",
                 "cache_aware needs the prefill nodes' store events", "4 problem(s)"):
        assert says in err, err
    assert main(["config", "--check", "--deploy.decode", "2", "--deploy.kv-base-port", "8102"]) == 2
    assert "port 8102 is both" in capsys.readouterr().err


def test_list_flags_repeat_like_vllms(capsys):
    assert main(["config", "--router.prefill", "http://a:8100", "--router.prefill", "http://b:8100",
                 "--engine.decode-args", "--max-num-seqs 8", "--engine.decode-args=--enforce-eager"]) == 0
    import yaml

    data = yaml.safe_load(capsys.readouterr().out)
    assert data["router"]["prefill"] == ["http://a:8100", "http://b:8100"]
    assert data["engine"]["decode_args"] == ["--max-num-seqs", "8", "--enforce-eager"]


def test_docs_config_md_is_current():
    """``docs/guide/configuration.md`` is ``kvrelay config --markdown``'s output: regenerate it when a key changes."""
    from kvrelay.deploy.config_doc import render

    path = Path(__file__).resolve().parents[2] / "docs" / "guide" / "configuration.md"
    assert path.read_text() == render(), "docs/guide/configuration.md is stale: run kvrelay config --markdown docs/guide/configuration.md"


def test_up_takes_the_model_first_and_vllms_own_arguments_after_a_double_dash(capsys):
    """``kvrelay up MODEL -- --enable-lora ...``, as ``vllm serve MODEL --enable-lora ...`` reads."""
    import yaml

    from kvrelay.cli import build_parser
    from kvrelay.core import config as kcfg

    args = build_parser().parse_args(["up", "org/model", "--deploy.decode", "2"])
    args.vllm_args = ["--enable-lora", "--max-loras", "2"]
    cfg = kcfg.config_from_args(args)
    assert (cfg.engine.model, cfg.engine.extra_args, cfg.deploy.decode) == ("org/model", ["--enable-lora", "--max-loras",
                                                                                         "2"], 2)
    assert main(["config", "--engine.extra-args=--enforce-eager", "--", "--enable-lora"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["engine"]["extra_args"] == ["--enforce-eager", "--enable-lora"]


def test_help_lists_each_flag_once_with_what_it_takes(capsys):
    from kvrelay.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: kvrelay up [MODEL] [options] [-- VLLM_ARGS...]")
    assert "--transport.pool-bytes SIZE" in out and "--transport.pool_bytes" not in out
    assert "--transport.backend {nixl,tcp,shm,ucx}" in out and "--router.decode-first {auto,true,false}" in out and "--router.expose-nodes {true,false}" in out
    assert " V\n" not in out and " V," not in out                        # no untyped metavar left
