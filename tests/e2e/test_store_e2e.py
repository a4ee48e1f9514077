"""Multi-turn reuse on real vLLM: turn 2's prefill loads turn 1's chunks from the store.

The prefill node runs with vLLM's own prefix cache off, so every reused token must come
from kvrelay's store (CPU tier, demoting to a disk tier) - and the answers must still
match a plain single vLLM server token for token.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.e2e.conftest import TURN1, openai_client, run_case, run_turn2, start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def store_stack(reference, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack-store")
    handle = start_stack(tiny_model, tmp, 18900, transport__backend="tcp", store__enabled=True,
                         store__cpu_bytes="64MiB", store__disk_path=str(tmp / "disk"), store__disk_bytes="256MiB",
                         engine__prefill_args=["--no-enable-prefix-caching"])
    yield handle
    handle.stack.stop()


def test_turn2_loads_turn1_prefix_from_store(store_stack, reference):
    client = openai_client(store_stack.router_url)
    r1, r2 = f"s1-{uuid.uuid4().hex[:6]}", f"s2-{uuid.uuid4().hex[:6]}"
    answer1, usage1 = run_case(client, TURN1, r1)
    assert answer1 == reference["turn1"]
    answer2 = run_turn2(client, answer1, r2)
    assert answer2 == reference["turn2"]
    events = [json.loads(x) for x in store_stack.events_path.read_text().splitlines()]
    loads = [e for e in events if e["event"] == "store_load"]
    assert loads, "turn 2 did not load anything from the store"
    shared = usage1["prompt_tokens"]                 # turn 2's prompt starts with turn 1's prompt
    assert loads[-1]["loaded_tokens"] >= shared - 256, (loads[-1], shared)
    # D still received the whole prompt by push (P pushes loaded chunks like computed ones).
    done = [e for e in events if e["event"] == "load_done" and r2 in e["transfer"]]
    assert done and done[0]["recomputed_tokens"] == 0
