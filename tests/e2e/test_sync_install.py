"""A transfer wholly landed before D schedules its request is installed inside that step
(``connector.sync_landed``); a chunk that fails there is recomputed, and the answer stays exact.

Real vLLM, nixl, token 1 from P. nixl's bytes are verified as D installs them, not as they land,
so a chunk corrupted after its checksum still counts as landed and fails inside the synchronous
install. The decode node is kept busy by a long answer streamed from it directly: a busy engine
steps, and every step its workers report what has landed, so the split requests' continuations
find their transfers there.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import requests

from kvrelay.deploy.launch import Role
from tests.e2e.harness import (
    CASES,
    MODEL,
    assert_corrupted_chunks_recomputed,
    openai_client,
    retire,
    run_case,
    start_stack,
)

pytestmark = pytest.mark.slow
PORT0 = 20600
CORRUPT = [CASES[4], CASES[6], CASES[10], CASES[13]]       # several chunks each: some corrupted, some not


@pytest.fixture(scope="module")
def sync_stack(reference, tiny_model, tmp_path_factory):
    handle = start_stack(tiny_model, tmp_path_factory.mktemp("stack-sync"), PORT0, transport__backend="nixl",
                         router__first_token="prefill", connector__push_hook="tests.e2e.faults:corrupt_every_other")
    yield handle
    retire(handle.stack)


def _keep_busy(url: str, stop: threading.Event) -> None:
    """Long greedy answers streamed from D itself, one after another, until ``stop``."""
    while not stop.is_set():
        with requests.post(f"{url}/v1/completions", stream=True, timeout=120, json={
                "model": MODEL, "prompt": "busy " * 50, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break


def test_chunks_failing_inside_the_scheduling_step_are_recomputed_exactly(sync_stack, reference):
    d_url = sync_stack.stack.url(next(s for s in sync_stack.stack.specs if s.role is Role.DECODE))
    stop = threading.Event()
    busy = threading.Thread(target=_keep_busy, args=(d_url, stop), daemon=True)
    busy.start()
    loads = []
    try:
        client = openai_client(sync_stack.router_url)
        for case in CORRUPT * 2:
            rid = f"sync-{case.name}-{uuid.uuid4().hex[:6]}"
            text, _ = run_case(client, case, rid)
            assert text == reference[case.name], f"{case.name}: a chunk that failed inside the step leaked"
            loads += [e for e in sync_stack.wait_events(rid, {"load_done"}) if e["event"] == "load_done"]
    finally:
        stop.set()
        busy.join(130)
    now = [e for e in loads if e["now"]]
    assert now, f"no continuation found its transfer landed ({len(loads)} loads): nothing was installed in-step"
    failed = [e for e in now if e["failed"]]
    assert failed, "no in-step install met a corrupted chunk: the recompute inside the step was not tested"
    for e in failed:
        assert all("checksum" in why for why in e["failed"].values()), e
        assert e["recomputed_tokens"] > 0, e


def test_corrupted_chunks_over_nixl_are_caught_in_the_install_and_recomputed(sync_stack, reference):
    """nixl does not hash on arrival: the decode node scatters each chunk from its slot and
    verifies the bytes it installed (decode/installer.py). Corrupted chunks must fail that
    check, be recomputed, and the answer must stay exact (D idle here: the install after the
    step, where the test above makes it inside the step)."""
    assert_corrupted_chunks_recomputed(sync_stack, reference, CASES[7])
