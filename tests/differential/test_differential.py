"""kvrelay answers every generated request exactly as one plain vLLM does.

200 requests drawn at a fixed seed from the surface real clients use
(:mod:`tests.differential.surface`) go to one plain vLLM (same dtype, same OpenMP binding as
each engine), then to the shared tcp and nixl 1P1D stacks, each through both
``router.first_token`` modes at once, 4 in flight through each. Any difference fails the test and
names the request. ``python -m tests.differential`` runs longer sweeps.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from tests.differential import run  # noqa: E402
from tests.differential.compare import Answer  # noqa: E402
from tests.differential.surface import Request, Surface  # noqa: E402
from tests.e2e.harness import PlainServers, read_events, retire, start_stack  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]   # a reference server, 200 requests x 2 routers
SEED, N = 20261203, int(os.environ.get("KVRELAY_DIFF_N", "200"))
BUSY_N = 60          # unseeded requests through the busy prefill node (the decoders beside them make it preempt)


@pytest.fixture(scope="session")
def diff_requests() -> list[Request]:
    return Surface(SEED).draw(N)


@pytest.fixture(scope="session")
def diff_reference(diff_requests: list[Request], plain: PlainServers) -> list[Answer]:
    with plain.use(2) as urls:
        return run.answers_from(urls, diff_requests, concurrency=4)


def _assert_same(diffs: list[run.Difference]) -> None:
    assert not diffs, f"{len(diffs)} differences from one vLLM:\n" + "\n".join(map(str, diffs[:25]))


def test_every_request_is_answered_as_one_vllm_answers_it(diff_requests, diff_reference, pd_stack,
                                                          record_property):
    routers, proc = run.routers_of(pd_stack.stack, pd_stack.cfg.router.port + 1)
    diffs = []
    try:   # both modes at once, 4 requests in flight each: the engines serve 8, as a shared pool would
        with ThreadPoolExecutor(len(routers)) as pool:
            targets = {mode: f"{pd_stack.cfg.transport.backend.value}/{mode}" for mode in routers}
            asked = {mode: pool.submit(run.ask, url, diff_requests, 4, targets[mode]) for mode, url in routers.items()}
            for mode in sorted(asked):
                diffs += run.compare(diff_requests, diff_reference, asked[mode].result(), targets[mode])
    finally:
        run.launch.stop_group(proc)
    _assert_same(diffs)
    # With 4 requests in flight the decode node is busy, and a split request (token 1 from P) often
    # finds its whole transfer landed: it is installed inside the step that schedules it
    # (connector.sync_landed). The run above must have taken that path too, and stayed exact.
    loads = [e for e in read_events(pd_stack.events_path) if e["event"] == "load_done"]
    now = sum(bool(e.get("now")) for e in loads)
    record_property("installs_in_step", now)
    print(f"{now} of {len(loads)} decode-side installs ran inside the step that scheduled them")
    assert now > 0, "no split request found its transfer landed: the synchronous install was not tested"


@pytest.mark.chaos
def test_a_busy_prefill_node_still_answers_as_one_vllm(diff_requests, diff_reference, tiny_model,
                                                        tmp_path_factory, record_property):
    """A prefill node with a small KV cache and token budget, 16 requests in flight and requests
    decoding on it directly: its scheduler runs out of blocks mid-prefill and preempts.
    vLLM's own preemption count is reported (and the run must see at least one)."""
    handle = start_stack(tiny_model, tmp_path_factory.mktemp("busy"), 18500, transport__backend="tcp",
                         engine__prefill_args=run.busy_prefill_args())
    # Seeded requests stay out: under load a decode node recomputes a preempted transfer's prompt
    # over several steps, and vLLM 0.32's CPU build then kills its engine on any seeded request
    # ("CPU Generator does not use offset"; surface.SEEDED_MAX_PROMPT, README Troubleshooting).
    pairs = [(r, a) for r, a in zip(diff_requests, diff_reference, strict=True) if "seed" not in r.body][:BUSY_N]
    reqs, want = [r for r, _ in pairs], [a for _, a in pairs]
    try:
        p_url = handle.stack.url(next(s for s in handle.stack.specs if s.role is run.launch.Role.PREFILL))
        with run.Decoders(p_url):
            have = run.ask(handle.router_url, reqs, 16, "busy")
        diffs = run.compare(reqs, want, have, "tcp-busy/prefill")
        count = run.preemptions(p_url)
        record_property("prefill_preemptions", count)
        print(f"busy prefill node: {count:g} preemptions (vllm:num_preemptions_total)")
        assert count > 0, "the busy prefill node never preempted: the run tested nothing busy"
    finally:
        retire(handle.stack)
    _assert_same(diffs)
