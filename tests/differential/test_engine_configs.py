"""Every engine configuration kvrelay accepts answers exactly as one vLLM with the same flags.

The configurations and the paths each is asked through are :mod:`tests.differential.configs`.
CI runs the ones marked ``ci`` (LoRA, a bfloat16 KV cache, n-gram speculative decoding, a
sliding window); ``--matrix`` runs the rest. ``python -m tests.differential --config NAME --n 300``
runs a longer sweep of one.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from tests.differential.configs import CASES, NGRAM, EngineCase, run_case  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
SEED, N = 20261206, int(os.environ.get("KVRELAY_CONFIG_N", "16"))


NEAR = pytest.mark.xfail(reason="measured on vLLM's CPU build: 0-1 of 16 greedy answers of a bfloat16 or float16 "
                          "model differ from one vLLM's at a near-tie (token 1's KV from a prefill, a store hit's "
                          "tail), with every chunk intact", strict=False)


def _marks(case: EngineCase) -> tuple[pytest.MarkDecorator, ...]:
    return (() if case.ci else (pytest.mark.matrix,)) + ((NEAR,) if case.near else ())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_marks(c)) for c in CASES])
def test_an_engine_configuration_answers_as_one_vllm_with_its_flags(case: EngineCase, tmp_path_factory,
                                                                     record_property):
    out = run_case(case, N, SEED, tmp_path_factory.mktemp(f"config-{case.name}"))
    record_property("config_rows", out.rows)
    print(f"[{case.name}] {out.requests} requests x 3 paths + {out.migrated:.0f} migrated streams, "
          f"{out.store_hits} store loads, {len(out.differences)} differences, {out.wall_s:.0f} s")
    assert not out.differences, f"{len(out.differences)} differences from one vLLM:\n" + "\n".join(
        map(str, out.differences[:25]))
    assert out.store_hits > 0, "no request loaded from the store: the second round did not test it"
    assert out.migrated >= 1, "the kill moved (or, in decode mode, cut) no stream: the migration was not tested"


REFUSED = {   # id: (engine flags, the model's attention, what vLLM's exit must name)
    "kv-bfloat16": (["--kv-cache-dtype", "bfloat16"], "full", "--kv-cache-dtype bfloat16"),
    "ngram": (["--speculative-config", NGRAM], "full", "--speculative-config method 'ngram'"),
    "sliding": ([], "sliding", "sliding_window on every layer"),
}


@pytest.fixture(scope="module")
def refused_logs(tmp_path_factory) -> dict[str, str]:
    """Each refused configuration on an engine started by hand (no kvrelay up/serve preflight),
    the three at once (their start is mostly imports, one core each): id -> the engine's log."""
    from kvrelay.deploy import launch
    from kvrelay.deploy.tiny_model import ensure_tiny_model
    from tests.e2e.harness import EAGER, _cfg

    tmp = tmp_path_factory.mktemp("refused")
    procs, logs = {}, {}
    try:
        for k, (name, (args, attention, _)) in enumerate(REFUSED.items()):
            port = 18880 + 4 * k
            model = ensure_tiny_model(tmp / f"model-{attention}", attention=attention)
            cfg = _cfg(model, tmp / name, port, engine__extra_args=[*EAGER, *args])
            logs[name] = tmp / f"{name}.log"
            with open(logs[name], "w") as out:
                procs[name] = launch.spawn_group(launch.server_command(
                    cfg, launch.NodeSpec(launch.Role.DECODE, 0, port, port + 1)), launch.server_env(cfg, 0, 2), out)
        for k, name in enumerate(REFUSED):
            with pytest.raises(RuntimeError, match="server exited"):
                launch.wait_healthy(f"http://127.0.0.1:{18880 + 4 * k}", procs[name], 300, str(logs[name]))
    finally:
        for proc in procs.values():
            launch.stop_group(proc)
    return {name: path.read_text() for name, path in logs.items()}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_configuration_fails_when_vllm_starts_not_at_a_request(refused_logs, name):
    """An engine started by hand with a configuration kvrelay refuses: vLLM exits when it builds
    the connector, naming the flag. (Measured before they were refused, through every path: a
    bfloat16 KV cache under a float32 model changed 14 of 16 answers; n-gram speculation killed
    the decode engine's sampler.)"""
    text = refused_logs[name]
    assert "kvrelay cannot serve this engine configuration exactly" in text, text[-2000:]
    assert REFUSED[name][2] in text, text[-2000:]
