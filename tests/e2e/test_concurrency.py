"""Hardening chaos (a): concurrent traffic with shared prefixes is token-exact.

32 requests at once over 4 shared system prompts that no engine has cached yet, 1 to 8
chunks each, chat and completion, streaming and not. Prefix sharing is what makes D's
held-chunk answer and P's pushes interleave; every answer must equal the plain single
vLLM server's (same dtype, same thread binding). The stack's leak check runs after this.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.harness import CONCURRENT, openai_client, read_events, run_shared

pytestmark = pytest.mark.chaos


def test_concurrent_shared_prefix_streams_are_token_exact(pd_stack, reference):
    client = openai_client(pd_stack.router_url)
    with ThreadPoolExecutor(max_workers=len(CONCURRENT)) as pool:
        answers = dict(zip([c.name for c in CONCURRENT],
                           pool.map(lambda c: run_shared(client, c, f"{c.name}-{pd_stack.cfg.transport.backend.value}"),
                                    CONCURRENT), strict=True))
    wrong = {name: (answers[name], reference[name]) for name in answers if answers[name] != reference[name]}
    assert not wrong, f"{len(wrong)} of {len(CONCURRENT)} answers differ from the reference: {wrong}"
    # transfer ids are the router's own, "kvr-<32 hex>-<the client's X-Request-Id when plain>"
    ours = {f"{c.name}-{pd_stack.cfg.transport.backend.value}" for c in CONCURRENT}
    loads = [e for e in read_events(pd_stack.events_path)
             if e["event"] == "load_done" and e["transfer"].split("-", 2)[-1] in ours]
    assert len(loads) == len(CONCURRENT), f"{len(loads)} decode-side loads for {len(CONCURRENT)} requests"
    full = [e for e in loads if e["recomputed_tokens"] == 0]
    assert len(full) >= len(CONCURRENT) // 2, f"only {len(full)} requests were fully loaded from pushed chunks"
