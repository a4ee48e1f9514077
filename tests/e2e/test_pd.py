"""End to end on real vLLM (CPU): router -> prefill node pushes chunks -> decode node installs them.

Oracle: a plain single vLLM server's greedy output for the same prompt (``reference``).
The tiny model's output depends on far context (see kvrelay.tiny_model), so a wrong
or missing KV chunk changes the answer - the negative control below proves it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
import uuid

import pytest

from kvrelay.deploy.launch import Role
from tests.e2e.harness import (
    BLOCK,
    CASES,
    FORMAT_REQS,
    MODEL,
    PIPELINE_CASE,
    Case,
    assert_corrupted_chunks_recomputed,
    openai_client,
    raw_post,
    retire,
    run_case,
    scrape,
    start_stack,
    thread_cpu,
)

pytestmark = pytest.mark.slow


def _rid(stack, case) -> str:
    return f"t-{stack.cfg.transport.backend.value}-{case.name}-{uuid.uuid4().hex[:6]}"


def test_reference_depends_on_prompt(reference):
    # The oracle itself must discriminate: different prompts, different continuations (over the
    # independent cases; the concurrency cases share system prompts on purpose).
    answers = {c.name: reference[c.name] for c in CASES}
    assert len(set(answers.values())) >= len(answers) // 2, answers


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_pd_matches_single_vllm(pd_stack, reference, case):
    client = openai_client(pd_stack.router_url)
    rid = _rid(pd_stack, case)
    text, usage = run_case(client, case, rid)
    assert text == reference[case.name], f"{case}: PD output differs from single vLLM"
    assert usage is not None and usage["completion_tokens"] == len(text)
    evs = pd_stack.wait_events(rid, {"load_done", "push_end"})
    done = [e for e in evs if e["event"] == "load_done"]
    assert len(done) == 1, evs
    d = done[0]
    assert d["prompt_tokens"] == usage["prompt_tokens"]
    assert d["recomputed_tokens"] == 0 and not d["failed"], d
    assert d["loaded_tokens"] >= d["prompt_tokens"] - BLOCK, d
    assert d["chunks"] == -(-d["prompt_tokens"] // 256)
    assert any(e["event"] == "push_end" and e["ok"] for e in evs), evs


def test_pipelined_install(pd_stack, reference):
    """On a 9-chunk prompt the transfer overlaps the rest. first_token=decode: D installs chunk 0
    before P has finished pushing the last chunk. first_token=prefill: D is only asked once P has
    answered, and by then the pushes are under way: P started pushing before D had the request."""
    case = PIPELINE_CASE
    rid = _rid(pd_stack, case)
    text, _ = run_case(openai_client(pd_stack.router_url), case, rid)
    assert text == reference[case.name]
    evs = pd_stack.wait_events(rid, {"load_done", "push_end"})
    done = next(e for e in evs if e["event"] == "load_done")
    n = done["chunks"]
    assert n >= 8 and done["recomputed_tokens"] == 0, done
    first_install = min(e["t_start"] for e in evs if e["event"] == "install" and e["chunk"] == 0)
    if pd_stack.cfg.router.first_token.value == "decode":
        last_push_done = max(e["t"] for e in evs if e["event"] == "push_done" and e["chunk"] == n - 1)
        assert first_install < last_push_done, (first_install, last_push_done)
    else:
        first_push = min(e["t"] for e in evs if e["event"] == "push_start" and e["chunk"] == 0)
        d_asked = min(e["t"] for e in evs if e["event"] == "load_start")
        assert first_push < d_asked <= first_install, (first_push, d_asked, first_install)


def test_repeated_prompt_sends_only_what_decode_lacks(pd_stack, reference):
    """A prompt D has seen sits in D's prefix cache: P is told those chunks are held and skips them."""
    case = CASES[6]                                  # c1100, already served once by this stack
    rid = _rid(pd_stack, case)
    text, _ = run_case(openai_client(pd_stack.router_url), case, rid)
    assert text == reference[case.name]
    evs = pd_stack.wait_events(rid, {"load_done", "push_end"})
    alloc = next(e for e in evs if e["event"] == "push_alloc")
    done = next(e for e in evs if e["event"] == "load_done")
    assert done["local_tokens"] >= 1024 and done["recomputed_tokens"] == 0, done
    local = list(range(done["local_tokens"] // 256))
    if pd_stack.cfg.router.first_token.value == "prefill":
        # P pushes before D has the request, so D cannot name what it holds: those chunks travel
        # (a known cost of the first token from P) but are not installed over D's own blocks.
        assert alloc["held"] == [], alloc
        assert not [e for e in evs if e["event"] == "install" and e["chunk"] in local]
        return
    assert alloc["held"] == local, (alloc, done)
    assert not [e for e in evs if e["event"] == "push_start" and e["chunk"] in alloc["held"]]


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _prefill_requests(stack) -> float:
    """Requests the prefill engine has finished or has running/waiting, from its own /metrics."""
    names = ("vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting")
    metrics = stack.engine_metrics(Role.PREFILL)
    counted = [v for k, v in metrics.items() if k.startswith(names)]
    assert counted, "the prefill engine exports none of the request metrics this test reads"
    return sum(counted)


VLLM_400 = ("Bad Request", "BadRequestError")     # vLLM 0.32: request validation, value errors


def test_router_rejects_bad_input_cleanly(pd_stack):
    """Bad input is judged by vLLM itself on a decode node alone (its own status and error
    body, as one vLLM answers it - tests/differential compares them); no prefill runs."""
    url = f"{pd_stack.router_url}/v1/completions"
    served = _prefill_requests(pd_stack)
    status, body, headers = _post(url, b"{not json", {"X-Request-Id": "bad-1"})
    assert status == 400 and body["error"]["type"] in VLLM_400, body
    assert headers.get("X-Request-Id") == "bad-1"
    status, body, _ = _post(url, b"[1, 2]")
    assert status == 400 and body["error"]["type"] in VLLM_400, body
    # What vLLM refuses is refused by vLLM; what would share one transfer is served by D alone.
    for bad, want in (({"n": 2}, 200), ({"max_tokens": 0}, 400), ({"prompt": ["a", "b"]}, 200),
                      ({"stream_options": {"include_usage": True}}, 400)):
        status, body, _ = _post(url, json.dumps({"model": "kvrelay-tiny", "prompt": "hi", "max_tokens": 4,
                                                 **bad}).encode())
        assert status == want and (want == 200 or body["error"]["type"] in VLLM_400), (bad, body)
    assert _prefill_requests(pd_stack) == served
    # Oversize prompt: vLLM's own 400 passes through; nothing is left behind (checked below).
    big = json.dumps({"model": "kvrelay-tiny", "prompt": "x" * 5000, "max_tokens": 4}).encode()
    status, body, _ = _post(url, big)
    assert status == 400 and "error" in body, body
    with urllib.request.urlopen(f"{pd_stack.router_url}/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == "kvrelay-tiny"
    with urllib.request.urlopen(f"{pd_stack.router_url}/health", timeout=30) as r:
        assert r.status == 200


def test_probe_sees_a_real_decode_node_engine_and_transfer_endpoint(pd_stack):
    # What the Kubernetes probes run (deploy/k8s.py): healthy while both answer, not when the
    # transfer port is not the node's.
    from kvrelay.deploy import probe

    d = next(s for s in pd_stack.stack.specs if s.role is Role.DECODE)
    assert probe.check("127.0.0.1", d.port, d.kv_port) == ""
    assert "transfer endpoint" in probe.check("127.0.0.1", d.port, d.kv_port + 7)


def test_no_leaked_slots_or_stuck_requests(pd_stack):
    """Runs after the stack served every case: pool empty, nothing in flight, engines idle."""
    import time

    deadline = time.monotonic() + 30
    while True:
        d, p = pd_stack.worker_metrics(Role.DECODE), pd_stack.worker_metrics(Role.PREFILL)
        engines = [pd_stack.engine_metrics(r) for r in (Role.PREFILL, Role.DECODE)]
        busy = (d["kvrelay_pool_slots_busy"], d['kvrelay_transfers_inflight{side="decode"}'],
                p['kvrelay_transfers_inflight{side="prefill"}'],
                *(sum(v for k, v in m.items() if k.startswith(("vllm:num_requests_running",
                                                               "vllm:num_requests_waiting")))
                  for m in engines))
        if not any(busy) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert busy == (0,) * 5, busy
    assert d["kvrelay_tokens_loaded_total"] > 0


def test_engines_park_between_requests_instead_of_spinning(pd_stack):
    """vLLM's engine core and worker busy-wait for 1 s after every message on their queue
    (core/vllm_plugin.py); the stack's engines get ``engine.mq_busy_loop_s`` (2 ms) through
    kvrelay's vLLM plugin. Measured in the second after a request, when vLLM's own window
    keeps two processes per engine spinning (near both cores of this host): the nodes'
    whole process groups must use under half a core."""
    client = openai_client(pd_stack.router_url)
    pgids = {p.pid for name, p in pd_stack.stack.procs.items() if name != "router"}

    def cpu_s() -> float:
        return sum(sum(thread_cpu(g).values()) for g in pgids)
    samples = []
    for case in CASES[:3]:
        run_case(client, case)
        t0, c0 = time.monotonic(), cpu_s()
        time.sleep(0.6)
        samples.append((cpu_s() - c0) / (time.monotonic() - t0))
    assert min(samples) < 0.5, f"the engines used {samples} cores in the 0.6 s after a request"


def test_connector_metrics_on_the_engines_own_metrics_endpoint(pd_stack):
    """The connectors' series reach each engine's own /metrics through vLLM's KV-connector
    stats hooks (core/engine_stats.py), with the values the worker's exporter shows: a decode
    load is reported in the engine step that finishes it, so after the run they are equal."""
    d_worker, d_engine = pd_stack.worker_metrics(Role.DECODE), pd_stack.engine_metrics(Role.DECODE)
    same = ["kvrelay_tokens_loaded_total", "kvrelay_transfer_latency_seconds_count",
            "kvrelay_transfer_latency_seconds_sum", "kvrelay_pool_slots"]
    assert d_worker["kvrelay_tokens_loaded_total"] > 0
    for key in same:
        assert d_engine.get(key) == pytest.approx(d_worker[key]), (key, d_engine.get(key), d_worker[key])
    p_worker, p_engine = pd_stack.worker_metrics(Role.PREFILL), pd_stack.engine_metrics(Role.PREFILL)
    pushed = [k for k in p_worker if k.startswith('kvrelay_chunks_total{') and 'side="prefill"' in k]
    assert pushed and all(0 < p_engine.get(k, 0) <= p_worker[k] for k in pushed), \
        {k: (p_engine.get(k), p_worker[k]) for k in pushed}


@pytest.fixture(scope="session")
def corrupt_stack(reference, tiny_model, tmp_path_factory):
    handle = start_stack(tiny_model, tmp_path_factory.mktemp("stack-corrupt"), 20500, transport__data_mac=True,
                         transport__backend="tcp", connector__push_hook="tests.e2e.faults:corrupt_every_other")
    yield handle
    retire(handle.stack)


@pytest.mark.parametrize("case", [CASES[4], CASES[7], CASES[10]], ids=lambda c: c.name)
def test_corrupted_chunks_are_rejected_and_recomputed(corrupt_stack, reference, case):
    """Negative control: every other pushed chunk is corrupted after checksumming. The stack signs
    every chunk (``transport.data_mac``): the intact ones must pass the MAC D checks over what
    it installs, so P's signature and D's check agree on real engines' KV."""
    d = assert_corrupted_chunks_recomputed(corrupt_stack, reference, case)
    assert not any("MAC" in why for why in d["failed"].values()), d          # only the corrupted ones failed
    assert d["loaded_tokens"] > 0 or "0" in map(str, d["failed"]), d          # a good chunk 0 was installed


def test_prometheus_scrapes_the_stack_and_the_recompute_alert_fires(corrupt_stack, reference, tmp_path):
    """A real Prometheus scrapes the stack (worker exporters, router) with the shipped alert
    rules (windows shortened): corrupted pushes make the recompute-ratio and checksum alerts
    fire, no other alert does, every series the dashboard uses exists, and the dashboard
    renders from the scrape."""
    from kvrelay.deploy import dashboard
    from tests.e2e.prom import api, firing, prometheus

    cfg = corrupt_stack.cfg
    targets = [f"127.0.0.1:{cfg.connector.metrics_port + s.port - cfg.deploy.base_port}"
               for s in corrupt_stack.stack.specs] + [f"127.0.0.1:{cfg.router.port}"]
    want = {"KVRelayRecomputeRatioHigh", "KVRelayChecksumRejections"}
    with prometheus(tmp_path, targets, 19990) as prom:
        client, case = openai_client(corrupt_stack.router_url), CASES[7]
        deadline = time.monotonic() + 120
        while not want <= firing(prom):
            assert time.monotonic() < deadline, f"alerts firing: {firing(prom)}"
            text, _ = run_case(client, case, _rid(corrupt_stack, case))
            assert text == reference[case.name]
            time.sleep(1.0)
        assert firing(prom) == want
        up = api(prom, "query", query="up")["result"]
        assert len(up) == len(targets) and all(r["value"][1] == "1" for r in up), up
        names = set(api(prom, "label/__name__/values")["result"])
        panels = json.loads(dashboard.DASHBOARD.read_text())["panels"]
        used = {m for p in panels for t in p["targets"] for m in re.findall(r"kvrelay_\w+", t["expr"])}
        store_only = {"kvrelay_store_records_forged_total", "kvrelay_store_hits_total", "kvrelay_store_misses_total"}
        assert used - store_only <= names, f"dashboard series missing from the scrape: {sorted(used - names)}"
        png = tmp_path / "dashboard.png"
        found = dashboard.render(prom, dashboard.DASHBOARD, 3, png)
        assert found["Prompt tokens loaded vs recomputed (per s)"] == 2 and png.stat().st_size > 20_000, found


def _events(raw: str) -> list:
    """SSE events (or one JSON answer) with the fields that differ between any two runs removed."""
    if raw.startswith("HTTP "):                 # an error: the status, then vLLM's error body
        status, _, raw = raw.partition(" ")[2].partition(" ")
        return [status, json.loads(raw)]
    parts = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")] if raw.startswith("data: ") else [raw]
    out = []
    for p in parts:
        if p == "[DONE]":
            out.append(p)
            continue
        ev = json.loads(p)
        ev.pop("id", None)
        ev.pop("created", None)
        if "system_fingerprint" in ev:         # a hash of the server's config: present, value server's own
            ev["system_fingerprint"] = "<fp>"
        out.append(ev)
    return out


def test_client_sees_what_one_vllm_emits(pd_stack, reference):
    """Field by field, in order (ids and timestamps aside): SSE events, usage, reasons, JSON answers,
    errors. (One test per stack, looping over the requests, so pytest keeps each stack's tests together.)"""
    for name in [n for n in FORMAT_REQS if n.startswith("fmt")]:
        path, body = FORMAT_REQS[name]
        before = _fallbacks(pd_stack.router_url)
        got, want = _events(raw_post(pd_stack.router_url, path, body).decode()), _events(reference[name])
        assert _fallbacks(pd_stack.router_url) == before, f"{name} took the decode path"
        # How many tokens one event carries depends on timing (vLLM merges outputs a slow reader has
        # not taken yet), in one vLLM too; so events are compared by shape, and the text as a whole.
        assert _shapes(got) == _shapes(want), name
        assert _text(got) == _text(want), name


def _fallbacks(router_url: str) -> float:
    """The router's count of requests sent down the decode path for a feature it cannot split."""
    return scrape(f"{router_url}/metrics").get(f'kvrelay_router_fallbacks_total{{cause="first_token_fallback",model_name="{MODEL}"}}', 0.0)


def _text(events: list) -> str:
    out = []
    for ev in events:
        for c in ev.get("choices", ()) if isinstance(ev, dict) else ():
            out.append(c.get("text") or (c.get("delta") or c.get("message") or {}).get("content") or "")
    return "".join(out)


def _shapes(events: list) -> list:
    """Each event with its text blanked (every other field kept), consecutive repeats collapsed."""
    def blank(x):
        if isinstance(x, dict):
            return {k: "<text>" if k in ("text", "content") and x[k] else blank(v) for k, v in x.items()}
        return [blank(v) for v in x] if isinstance(x, list) else x
    out: list = []
    for ev in events:
        b = blank(ev)
        if not out or out[-1] != b:
            out.append(b)
    return out


def test_features_that_cannot_be_split_fall_back_and_stay_exact(pd_stack, reference):
    def text(a: dict) -> str:
        return str(a["choices"][0].get("text") or a["choices"][0]["message"]["content"])
    for name in [n for n in FORMAT_REQS if n.startswith("fb")]:
        path, body = FORMAT_REQS[name]
        before, failed = _fallbacks(pd_stack.router_url), _failures(pd_stack.router_url)
        got, want = json.loads(raw_post(pd_stack.router_url, path, body)), json.loads(reference[name])
        split = pd_stack.cfg.router.first_token.value == "prefill"       # only then is there a fallback
        assert _fallbacks(pd_stack.router_url) == before + split, f"{name} did not take the decode path"
        assert _failures(pd_stack.router_url) == failed, f"{name}: a fallback counted as a failure"
        assert text(got) == text(want) and got["usage"] == want["usage"], name


def _failures(router_url: str) -> float:
    return sum(v for k, v in scrape(f"{router_url}/metrics").items() if k.startswith("kvrelay_router_request_failures"))


def test_the_routers_latency_families_are_vllms_with_its_model_name(pd_stack):
    """The router's first-token, inter-token and whole-request histograms carry vLLM's names
    (``vllm:time_to_first_token_seconds``...) under the router's prefix, with ``model_name``."""
    run_case(openai_client(pd_stack.router_url), next(c for c in CASES if c.stream))
    series = scrape(f"{pd_stack.router_url}/metrics")
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        count = series.get(f'kvrelay_router_{family}_count{{model_name="{MODEL}"}}', 0.0)
        assert count > 0, (family, [k for k in series if family in k][:3])
    assert all(f'model_name="{MODEL}"' in k for k in series if k.startswith("kvrelay_router_") and "{" in k)


# Each kvrelay family's Prometheus type: what is counted is a counter (``_total``), what is held
# a gauge, what is timed a histogram. Every name the connectors export must be listed here.
TYPES = {
    "kvrelay_tokens_loaded": "counter", "kvrelay_tokens_recomputed": "counter", "kvrelay_chunks": "counter",
    "kvrelay_bytes": "counter", "kvrelay_push_forced_frees": "counter", "kvrelay_store_chunks_stored": "counter",
    "kvrelay_store_tokens_loaded": "counter", "kvrelay_events_dropped": "counter",
    "kvrelay_store_records_forged": "counter", "kvrelay_store_hits": "counter", "kvrelay_store_bytes_loaded": "counter",
    "kvrelay_store_misses": "counter", "kvrelay_store_tier_errors": "counter", "kvrelay_store_evictions": "counter", "kvrelay_receiver_refusals": "counter",
    "kvrelay_params_refused": "counter",
    "kvrelay_chunk_load_latency_seconds": "histogram", "kvrelay_chunk_store_latency_seconds": "histogram",
    "kvrelay_transfer_latency_seconds": "histogram",
    "kvrelay_transfers_inflight": "gauge", "kvrelay_pool_slots_busy": "gauge", "kvrelay_pool_slots": "gauge",
    "kvrelay_receiver_entries": "gauge",
}


def _types(url: str) -> tuple[dict[str, str], str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^# TYPE (kvrelay_\w+) (\w+)$", text, re.M)
    # prometheus_client shows a counter's or histogram's creation time as a ``<name>_created``
    # gauge beside it (as vLLM's own series have): part of that family, not a metric of its own
    return {re.sub(r"_total$", "", n) if t == "counter" else n: t for n, t in found
            if not (n.endswith("_created") and TYPES.get(n.removesuffix("_created")) in ("counter", "histogram"))}, text


def test_metric_types_follow_prometheus_conventions_and_carry_vllms_labels(pd_stack):
    """Scraped from the real engines: counters are counters (``_total``), never gauges; every
    kvrelay series on an engine's /metrics carries vLLM's ``model_name`` and ``engine`` labels."""
    for role in (Role.PREFILL, Role.DECODE):
        spec = next(s for s in pd_stack.stack.specs if s.role is role)
        for url in (f"{pd_stack.stack.url(spec)}/metrics",
                    f"http://127.0.0.1:{pd_stack.cfg.connector.metrics_port + spec.port - pd_stack.cfg.deploy.base_port}/"):
            found, text = _types(url)
            assert found, f"no kvrelay series at {url}"
            wrong = {n: t for n, t in found.items() if TYPES.get(n) != t}
            assert not wrong, f"{url}: families of the wrong (or an unlisted) type: {wrong}"
            for line in text.splitlines():
                if line.startswith("kvrelay_") and line.split("{")[0].split(" ")[0].endswith("_total"):
                    assert TYPES.get(re.sub(r"_total$", "", line.split("{")[0].split(" ")[0])) == "counter", line
        engine = scrape(f"{pd_stack.stack.url(spec)}/metrics")
        ours = [k for k in engine if k.startswith("kvrelay_") and not k.startswith("kvrelay_params_refused")]
        assert ours and all('model_name="' in k and 'engine="' in k for k in ours), \
            [k for k in ours if 'model_name="' not in k][:5]
        assert all(f'model_name="{MODEL}"' in k for k in ours)


async def _abort_after_first_token(url: str, n: int, prompt_tokens: int) -> int:
    """``n`` streamed completions with long prompts, each dropped by the client at its first token."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": MODEL, "prompt": Case(f"abort{i}", "completion", True, prompt_tokens + 13 * i, 400).text(),
                "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    return 1                            # leaving the block closes the connection: an abort
        return 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return sum(await asyncio.gather(*(one(session, i) for i in range(n))))


def test_an_idle_decode_node_reads_zero_busy_slots_after_aborted_requests(pd_stack, reference):
    """Slots and receiver entries freed after the engine's last step (aborted requests) are not
    reported through an engine step: the engine's /metrics must still read 0 once the node is
    idle, within one scrape interval, and agree with the worker's own exporter."""
    assert asyncio.run(_abort_after_first_token(pd_stack.router_url, 8, 1800)) == 8
    spec = next(s for s in pd_stack.stack.specs if s.role is Role.DECODE)

    def running() -> float:
        m = pd_stack.engine_metrics(Role.DECODE)
        return sum(v for k, v in m.items() if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
    deadline = time.monotonic() + 60
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(), "the decode engine still has requests a minute after every client left"
    t_idle = time.monotonic()
    while True:
        engine = pd_stack.engine_metrics(Role.DECODE)
        held = (engine.get("kvrelay_pool_slots_busy"), engine.get("kvrelay_receiver_entries"),
                engine.get('kvrelay_transfers_inflight{side="decode"}', 0.0))
        if held == (0.0, 0.0, 0.0) or time.monotonic() - t_idle > 15:
            break
        time.sleep(0.5)
    assert held == (0.0, 0.0, 0.0), f"idle decode node {spec.name} reads (busy slots, entries, inflight) = {held}"
    assert engine["kvrelay_pool_slots"] == pd_stack.worker_metrics(Role.DECODE)["kvrelay_pool_slots"] > 0
    client = openai_client(pd_stack.router_url)                  # and the node still answers exactly
    case = CASES[4]
    assert run_case(client, case, _rid(pd_stack, case))[0] == reference[case.name]
