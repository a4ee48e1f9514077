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

from tests.differential.configs import CASES, EngineCase, run_case, runnable  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
SEED, N = 20261206, int(os.environ.get("KVRELAY_CONFIG_N", "16"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=() if c.ci else (pytest.mark.matrix,))
                                  for c in CASES])
def test_an_engine_configuration_answers_as_one_vllm_with_its_flags(case: EngineCase, tmp_path_factory,
                                                                     record_property):
    if why := runnable(case):
        pytest.skip(why)
    out = run_case(case, N, SEED, tmp_path_factory.mktemp(f"config-{case.name}"))
    record_property("config_rows", out.rows)
    print(f"[{case.name}] {out.requests} requests x 3 paths + {out.migrated:.0f} migrated streams, "
          f"{out.store_hits} store loads, {len(out.differences)} differences, {out.wall_s:.0f} s")
    assert not out.differences, f"{len(out.differences)} differences from one vLLM:\n" + "\n".join(
        map(str, out.differences[:25]))
    assert out.store_hits > 0, "no request loaded from the store: the second round did not test it"
    assert out.migrated >= 1, "the kill moved no stream: the migration was not tested"
