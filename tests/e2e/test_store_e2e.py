"""Multi-turn reuse on real vLLM: turn 2's prefill loads turn 1's chunks from the store.

The prefill node runs with vLLM's own prefix cache off, so every reused token must come
from kvrelay's store (CPU tier, demoting to disk and to a real redis-server) - and the
answers must still match a plain single vLLM server token for token. The decode node
saves the chunks its answers complete (``store.save_decoded``) into the same Redis.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import uuid

import pytest

from kvrelay.bench.local_redis import REDIS, redis_server
from kvrelay.deploy.launch import Role
from tests.e2e.harness import (
    DSAVE_ANSWER,
    MODEL,
    TURN1,
    dsave_messages,
    openai_client,
    retire,
    run_case,
    run_chat,
    run_turn2,
    scrape,
    start_stack,
)

pytestmark = pytest.mark.slow


_REDIS_PROCS: dict[str, subprocess.Popen] = {}


@pytest.fixture(scope="session")
def store_redis(tmp_path_factory):
    """A real redis-server shared by the store stack's nodes ("" when not installed)."""
    if REDIS is None:
        yield ""
        return
    with redis_server(tmp_path_factory.mktemp("redis-e2e")) as (url, proc):
        _REDIS_PROCS[url] = proc
        yield url
    with contextlib.suppress(ProcessLookupError):              # a restarted server (the outage test)
        _REDIS_PROCS[url].kill()


@pytest.fixture(scope="session")
def store_stack(reference, tiny_model, tmp_path_factory, store_redis):
    tmp = tmp_path_factory.mktemp("stack-store")
    redis = {"store__redis_url": store_redis, "store__save_decoded": True} if store_redis else {}
    handle = start_stack(tiny_model, tmp, 18900, transport__backend="tcp", store__enabled=True,
                         store__cpu_bytes="64MiB", store__disk_path=str(tmp / "disk"), store__disk_bytes="256MiB",
                         engine__prefill_args=["--no-enable-prefix-caching"], **redis)
    yield handle
    retire(handle.stack)


def test_turn2_loads_turn1_prefix_from_store(store_stack, reference):
    client = openai_client(store_stack.router_url)
    r1, r2 = f"s1-{uuid.uuid4().hex[:6]}", f"s2-{uuid.uuid4().hex[:6]}"
    answer1, usage1 = run_case(client, TURN1, r1)
    assert answer1 == reference["turn1"]
    answer2 = run_turn2(client, answer1, r2)
    assert answer2 == reference["turn2"]
    events = store_stack.events(r2)
    loads = [e for e in events if e["event"] == "store_load"]
    assert loads, ("turn 2 did not load anything from the store", store_stack.log_lines("prefill0", "store lookup"))
    shared = usage1["prompt_tokens"]                 # turn 2's prompt starts with turn 1's prompt
    assert loads[0]["loaded_tokens"] >= shared - 256, (loads[0], shared)
    # D still received the whole prompt by push (P pushes loaded chunks like computed ones).
    done = [e for e in events if e["event"] == "load_done"]
    assert done and done[0]["recomputed_tokens"] == 0


def test_decode_saves_answer_chunks_and_turn2_prefill_loads_them_from_redis(store_stack, store_redis, reference):
    if not store_redis:
        pytest.skip("redis-server not installed (deploy/setup.sh installs it)")
    client = openai_client(store_stack.router_url)
    r1, r2 = f"ds1-{uuid.uuid4().hex[:6]}", f"ds2-{uuid.uuid4().hex[:6]}"
    answer1 = run_chat(client, dsave_messages(), DSAVE_ANSWER, r1)
    assert answer1 == reference["dsave1"]
    # Turn 1's prompt (< 256 tokens) never filled a chunk on P; D's answer did.
    saved = next(e for e in store_stack.wait_events(r1, {"decode_save"}) if e["event"] == "decode_save")
    assert (saved["first_chunk"], saved["chunks"], saved["written"]) == (0, 1, 1), saved
    answer2 = run_chat(client, dsave_messages(answer1), 12, r2)
    assert answer2 == reference["dsave2"]
    evs = store_stack.wait_events(r2, {"store_load", "load_done"})
    load = next(e for e in evs if e["event"] == "store_load")
    assert load["loaded_tokens"] == 256 and load["tiers"].get("redis", 0) >= 1, load
    assert load["tier_bytes"].get("redis", 0) >= 2 << 20, load          # a 2 MiB chunk + its header
    done = [e for e in evs if e["event"] == "load_done"]
    assert done and done[0]["recomputed_tokens"] == 0


def test_a_poisoned_redis_record_is_a_counted_miss_and_the_answer_stays_exact(store_stack, store_redis, reference):
    """Security: someone with write access to Redis (but not the secret) replaces the chunk a
    decode node saved. The prefill node refuses it (bad MAC: counted in
    kvrelay_store_records_forged_total{tier="redis"}), recomputes, and the answer is exact."""
    if not store_redis:
        pytest.skip("redis-server not installed (deploy/setup.sh installs it)")
    import redis

    client = openai_client(store_stack.router_url)
    r1, r2 = f"px1-{uuid.uuid4().hex[:6]}", f"px2-{uuid.uuid4().hex[:6]}"
    answer1 = run_chat(client, dsave_messages(conv=3), DSAVE_ANSWER, r1)
    assert answer1 == reference["dsave1.3"]
    saved = next(e for e in store_stack.wait_events(r1, {"decode_save"}) if e["event"] == "decode_save")
    assert saved["written"] == 1, saved
    r = redis.Redis.from_url(store_redis)
    keys = list(r.scan_iter(b"kvrelay:*"))
    assert keys
    for k in keys:                          # a well-formed record (header + payload), but no valid MAC
        value = r.get(k)
        assert value is not None
        r.set(k, value[:-32] + bytes(32))
    before = store_stack.worker_metrics(Role.PREFILL).get('kvrelay_store_records_forged_total{tier="redis"}', 0)
    answer2 = run_chat(client, dsave_messages(answer1, 3), 12, r2)
    assert answer2 == reference["dsave2.3"]
    load = next(e for e in store_stack.wait_events(r2, {"store_load"}) if e["event"] == "store_load")
    assert load["loaded_tokens"] == 0, load                       # refused, so computed
    after = store_stack.worker_metrics(Role.PREFILL)['kvrelay_store_records_forged_total{tier="redis"}']
    assert after >= before + 1


@pytest.mark.chaos
def test_redis_killed_and_restarted_mid_conversation(store_stack, store_redis, reference):
    """Chaos (e): with Redis gone, the shared tier is a miss and every answer stays exact; once
    it is back (after the tier's 5 s retry window), decode-side saves and loads hit it again."""
    if not store_redis:
        pytest.skip("redis-server not installed (deploy/setup.sh installs it)")
    import redis

    client = openai_client(store_stack.router_url)
    proc = _REDIS_PROCS[store_redis]
    proc.kill()                                                   # SIGKILL: no shutdown, no save
    proc.wait()
    r1, r2 = f"rk1-{uuid.uuid4().hex[:6]}", f"rk2-{uuid.uuid4().hex[:6]}"
    answer1 = run_chat(client, dsave_messages(conv=1), DSAVE_ANSWER, r1)
    assert answer1 == reference["dsave1.1"]
    answer2 = run_chat(client, dsave_messages(answer1, 1), 12, r2)
    assert answer2 == reference["dsave2.1"]
    outage = [e for e in store_stack.wait_events(r2, {"store_load"}, 5) if e["event"] == "store_load"]
    assert all(e["tiers"].get("redis", 0) == 0 for e in outage), outage     # a miss, not an error

    port = store_redis.rsplit(":", 1)[1].split("/")[0]
    workdir = store_stack.stack.log_dir
    _REDIS_PROCS[store_redis] = subprocess.Popen(
        [REDIS, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(store_redis).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not come back"
            time.sleep(0.05)
    time.sleep(5.5)                                               # the tiers' retry window after an outage

    r3, r4 = f"rk3-{uuid.uuid4().hex[:6]}", f"rk4-{uuid.uuid4().hex[:6]}"
    answer3 = run_chat(client, dsave_messages(conv=2), DSAVE_ANSWER, r3)
    assert answer3 == reference["dsave1.2"]
    saved = next(e for e in store_stack.wait_events(r3, {"decode_save"}) if e["event"] == "decode_save")
    assert saved["written"] == 1, saved
    answer4 = run_chat(client, dsave_messages(answer3, 2), 12, r4)
    assert answer4 == reference["dsave2.2"]
    load = next(e for e in store_stack.wait_events(r4, {"store_load"}) if e["event"] == "store_load")
    assert load["tiers"].get("redis", 0) >= 1, load


@pytest.fixture(scope="session")
def two_prefill_stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack-route")
    handle = start_stack(tiny_model, tmp, 19500, transport__backend="tcp", store__enabled=True,
                         store__cpu_bytes="64MiB", store__publish_port=19700, deploy__prefill=2,
                         router__policy="cache_aware", router__expose_nodes=True,
                         engine__prefill_args=["--no-enable-prefix-caching"])
    yield handle
    retire(handle.stack)


def _prefill_of(url: str, prompt: str) -> str:
    import urllib.request

    body = json.dumps({"model": "kvrelay-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        return r.headers["X-Kvrelay-Prefill"]


def _prefill_nodes(stack) -> list[str]:
    return [stack.stack.url(s) for s in stack.stack.specs if s.role is Role.PREFILL]


def _warm(stack, node: str, prefix: str, tmp_path) -> None:
    """Store ``prefix``'s 4 chunks on ``node`` with `kvrelay warmup` (counted from its worker
    metrics) and give the store events time to reach the router."""
    import sys

    prompts = tmp_path / "hot.jsonl"
    prompts.write_text(json.dumps({"prompt": prefix}) + "\n")
    index = _prefill_nodes(stack).index(node)
    metrics = f"http://127.0.0.1:{stack.cfg.connector.metrics_port + index}/"
    warm = subprocess.run([sys.executable, "-m", "kvrelay.cli", "warmup", "--prompts", str(prompts), "--url", node,
                           "--metrics", metrics], capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    assert f"1 prompts, {len(prefix)} prompt tokens, 4 chunks stored" in warm.stderr, warm.stderr
    time.sleep(1.0)                                          # store events reach the router


def _pending_tokens(router_url: str, node: str) -> float:
    series = f'kvrelay_router_prefill_pending_tokens{{model_name="{MODEL}",node="{node}"}}'   # router.expose_nodes: the URL
    value = scrape(f"{router_url}/metrics").get(series)
    assert value is not None, f"no pending-tokens series for {node}"
    return value


def test_cache_aware_routing_prefers_the_node_holding_the_prefix(two_prefill_stack, tmp_path):
    from tests.e2e.harness import Case
    from tests.e2e.routers import second_router

    stack = two_prefill_stack
    node_b = _prefill_nodes(stack)[1]
    prefix = Case("warm", "completion", False, 1100, 77).text()
    _warm(stack, node_b, prefix, tmp_path)
    picks = [_prefill_of(stack.router_url, prefix + Case(f"q{i}", "completion", False, 40, i).text())
             for i in range(4)]
    assert picks == [node_b] * 4, picks
    # The same pools behind a round-robin router: the prefix does not attract requests.
    with second_router(stack, "round-robin", 19590, policy="round_robin") as rr:
        picks_rr = [_prefill_of(rr.router_url, prefix + Case(f"r{i}", "completion", False, 40, i).text())
                    for i in range(4)]
    assert len(set(picks_rr)) == 2 and picks_rr.count(node_b) == 2, picks_rr


def test_a_busy_prefix_holder_stops_attracting_new_conversations(two_prefill_stack, tmp_path):
    # Node A holds a shared 1,024-token prefix. A long prompt with that prefix goes to A
    # (2,576 tokens to compute there, 3,600 elsewhere); while A prefills it, a short new
    # conversation with the same prefix must go to idle B (1,140 tokens there against A's
    # 76 + the 2,576 queued). A per-request load count keeps sending it to A (4 cached chunks
    # outweigh 1 outstanding request). Once A has answered, A (holding the long prompt's
    # chunks now) wins its continuations again.
    import concurrent.futures

    from tests.e2e.harness import Case

    stack = two_prefill_stack
    node_a, node_b = _prefill_nodes(stack)
    prefix = Case("shared", "completion", False, 1100, 78).text()
    _warm(stack, node_a, prefix, tmp_path)
    long_prompt = prefix + Case("long", "completion", False, 2500, 79).text()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_pick = pool.submit(_prefill_of, stack.router_url, long_prompt)
        deadline = time.monotonic() + 60
        while _pending_tokens(stack.router_url, node_a) < 2576:
            assert not long_pick.done() and time.monotonic() < deadline, "the long prompt was never queued on A"
            time.sleep(0.002)
        short_pick = _prefill_of(stack.router_url, prefix + Case("new", "completion", False, 40, 80).text())
        assert long_pick.result() == node_a
    assert short_pick == node_b
    assert _pending_tokens(stack.router_url, node_a) == 0 and _pending_tokens(stack.router_url, node_b) == 0
    time.sleep(1.0)                                          # A's store events for the long prompt
    assert _prefill_of(stack.router_url, long_prompt[:3000] + Case("idle", "completion", False, 40, 81).text()) == node_a
