"""Tensor parallelism on real vLLM (CPU build, ``--distributed-executor-backend mp``), equal and mixed.

* Equal TP2 (P TP2 -> D TP2): every e2e case, streamed and not, token-identical to one vLLM at
  TP2 with the same dtype and the same per-rank OpenMP binding (one core per rank), and every
  prompt token loaded on both decode ranks, none recomputed.
* Mixed TP (P TP2 -> D TP1, P TP1 -> D TP2): D's installed KV is byte-identical to P's KV
  re-sharded. Every rank's blocks of a multi-chunk prompt are read through the inspect hook
  (:mod:`tests.e2e.kv_dump`), joined along the head axis and compared whole, every layer and block.
  Greedy answers are compared with one vLLM at D's TP; a difference is reported with its first
  differing position.

Each stack runs over tcp and over nixl.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.harness import (
    CASES,
    Case,
    PlainServers,
    answers_of,
    openai_client,
    read_events,
    reference_at_tp,
    retire,
    run_case,
    scrape,
    start_stack,
    stop_active,
    without_vllm_labels,
)
from tests.e2e.kv_dump import DUMP_ENV

pytestmark = pytest.mark.slow

DUMP_CASE = Case("tp-dump", "completion", False, 1300, 4242)       # 6 chunks, a partial tail
MIXED_CASES = [DUMP_CASE, *(c for c in CASES if c.name in {"c257", "h500", "c1024", "h1700"})]
HOOK = "tests.e2e.kv_dump:dump"
FAULT_STACK = (1, 2, "tcp")          # the stack whose decode rank 1 the last test kills
STORE_STACK = (2, 2, "tcp")          # the stack whose prefill node runs the store
PORTS = {(2, 2, "tcp"): 21000, (2, 2, "nixl"): 21200, (2, 1, "nixl"): 21400, (2, 1, "tcp"): 21600,
         (1, 2, "tcp"): 21800, (1, 2, "nixl"): 22200}            # clear of every other suite's ports


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def references(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
               plain: PlainServers) -> dict[int, dict[str, str]]:
    stop_active()
    tmp = tmp_path_factory.mktemp("tp-reference")
    with plain.use(2) as urls:
        tp1 = answers_of(urls, MIXED_CASES)
    return {2: reference_at_tp(tiny_model, tmp, 2, [*CASES, DUMP_CASE]), 1: tp1}


CI_STACKS = {(2, 2, "tcp"), (2, 1, "nixl"), (1, 2, "tcp")}    # equal and both mixed directions, both transports


@pytest.fixture(scope="module", ids=[f"p{p}d{d}-{b}" for p, d, b in sorted(PORTS)],
                params=[pytest.param(k, marks=() if k in CI_STACKS else pytest.mark.matrix) for k in sorted(PORTS)])
def tp_stack(request: pytest.FixtureRequest, references: Any, tiny_model: Path,
             tmp_path_factory: pytest.TempPathFactory):
    p_tp, d_tp, backend = request.param
    tmp = tmp_path_factory.mktemp(f"tp-{p_tp}{d_tp}-{backend}")
    dump = tmp / "kv"
    dump.mkdir()
    os.environ[DUMP_ENV] = str(dump)             # the engines inherit it (launch.server_env copies os.environ)
    try:
        fault = {"connector__push_hook": "tests.e2e.faults:slow_when_asked"} if request.param == FAULT_STACK else {}
        if request.param == STORE_STACK:         # each prefill rank stores and reloads its own heads
            fault.update(store__enabled=True, store__cpu_bytes="64MiB", store__disk_path=str(tmp / "disk"),
                         store__disk_bytes="256MiB", engine__prefill_args=["--no-enable-prefix-caching"])
        handle = start_stack(tiny_model, tmp, PORTS[request.param], transport__backend=backend,
                             engine__prefill_tp=p_tp, engine__decode_tp=d_tp, connector__metrics_port=0,
                             connector__inspect_hook=HOOK, **fault)
    finally:
        del os.environ[DUMP_ENV]
    yield handle, p_tp, d_tp, dump
    retire(handle.stack)


def _loads(handle: Any, rid: str, d_tp: int, timeout: float = 30) -> list[dict]:
    """The ``load_done`` events of ``rid``: one per decode rank, each written as its install ends."""
    deadline = time.monotonic() + timeout
    while True:
        done = [e for e in handle.events(rid) if e["event"] == "load_done"]
        if len(done) >= d_tp or time.monotonic() > deadline:
            return done
        time.sleep(0.1)


def test_tp_answers_match_one_vllm_and_nothing_is_recomputed(tp_stack, references):
    handle, p_tp, d_tp, _dump = tp_stack
    cases = CASES if p_tp == d_tp else MIXED_CASES[1:]
    client = openai_client(handle.router_url)
    differences = []
    for case in cases:
        rid = f"tp-{case.name}-{uuid.uuid4().hex[:6]}"
        text, usage = run_case(client, case, rid)
        want = references[d_tp][case.name]
        if text != want:
            differences.append(f"{case.name}: first difference at character {_first_difference(text, want)} "
                               f"(PD {text!r}, one vLLM at TP{d_tp} {want!r})")
        loads = _loads(handle, rid, d_tp)
        assert len(loads) == d_tp, loads                     # one install per decode rank
        for d in loads:
            assert d["recomputed_tokens"] == 0 and not d["failed"], d
            assert d["loaded_tokens"] + d["local_tokens"] >= usage["prompt_tokens"] - 1, d
    assert not differences, "\n".join(differences)


def _global(dumps: list[dict], heads_total: int) -> torch.Tensor:
    """Rank dumps ``[L, n, bpb_rank]`` joined along the head axis: ``[L, n, H, head_bytes]``."""
    dumps = sorted(dumps, key=lambda d: d["rank"])
    parts = [d["kv"].view(d["kv"].shape[0], d["kv"].shape[1], d["heads"], -1) for d in dumps]
    out = torch.cat(parts, dim=2)
    assert out.shape[2] == heads_total, [tuple(p.shape) for p in parts]
    return out


def test_installed_kv_is_the_prefill_kv_resharded(tp_stack, references):
    handle, p_tp, d_tp, dump = tp_stack
    for f in dump.glob("*.pt"):
        f.unlink()
    rid = f"tp-dump-{uuid.uuid4().hex[:6]}"
    text, _ = run_case(openai_client(handle.router_url), DUMP_CASE, rid)
    loads = _loads(handle, rid, d_tp)
    assert len(loads) == d_tp and all(d["recomputed_tokens"] == 0 and not d["failed"] for d in loads), loads
    files = [torch.load(f) for f in sorted(dump.glob("*.pt"))]
    pre = [d for d in files if d["role"] == "prefill"]
    dec = [d for d in files if d["role"] == "decode"]
    assert sorted(d["rank"] for d in pre) == list(range(p_tp)), [(d["role"], d["rank"]) for d in files]
    assert sorted(d["rank"] for d in dec) == list(range(d_tp)), [(d["role"], d["rank"]) for d in files]
    heads = sum(d["heads"] for d in pre)
    p_kv, d_kv = _global(pre, heads), _global(dec, heads)
    assert p_kv.shape == d_kv.shape and p_kv.shape[1] == -(-DUMP_CASE.prompt_len // 128), (p_kv.shape, d_kv.shape)
    for layer in range(p_kv.shape[0]):
        for block in range(p_kv.shape[1]):
            assert torch.equal(p_kv[layer, block], d_kv[layer, block]), f"layer {layer} block {block} differs"
    want = references[d_tp][DUMP_CASE.name]
    assert text == want, f"first difference at character {_first_difference(text, want)}: {text!r} vs {want!r}"
    assert read_events(handle.events_path)                 # the transfer log was written


def test_each_prefill_rank_reloads_its_own_heads_from_the_store(tp_stack, references):
    """The store with TP: a prompt seen before is loaded from the store on both prefill ranks
    (each its own per-layout records, on its own disk directory), pushed, and answered exactly."""
    handle, p_tp, d_tp, _dump = tp_stack
    if (p_tp, d_tp, handle.cfg.transport.backend.value) != STORE_STACK:
        pytest.skip("runs on the stack with the store on")
    case = next(c for c in CASES if c.name == "c1100")
    client = openai_client(handle.router_url)
    rids = [f"tp-store-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    for rid in rids:
        text, _ = run_case(client, case, rid)
        assert text == references[2][case.name]
    loads = [e for e in handle.wait_events(rids[1], {"store_load"}) if e["event"] == "store_load"]
    deadline = time.monotonic() + 30
    while len(loads) < p_tp and time.monotonic() < deadline:
        time.sleep(0.2)
        loads = [e for e in handle.events(rids[1]) if e["event"] == "store_load"]
    assert len({e["node"] for e in loads}) == p_tp, loads              # one load on each prefill rank
    assert all(e["loaded_tokens"] >= 1024 for e in loads), loads
    assert sorted(p.name for p in (handle.stack.log_dir.parent / "disk").iterdir()) == ["rank0", "rank1"]
    done = _loads(handle, rids[1], d_tp)
    assert len(done) == d_tp and all(d["recomputed_tokens"] == 0 for d in done), done


def _worker_pid(pgid: int, title: str) -> int:
    """The pid of the process in group ``pgid`` whose title names it (vLLM: ``VLLM::Worker_TP1``)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) == pgid and title in (proc / "cmdline").read_bytes().decode(errors="replace"):
                return int(proc.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no process titled {title!r} in group {pgid}")


def _healthy(url: str, wait_s: float) -> bool:
    """Whether ``url``/health still answers 200 after up to ``wait_s`` (False as soon as it does not)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
        time.sleep(0.5)
    return True


def _prefill_idle(handle: Any) -> bool:
    m = without_vllm_labels(scrape(f"{handle.stack.url(handle.stack.specs[0])}/metrics"))
    busy = [v for k, v in m.items() if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc", "kvrelay_transfers_inflight"))]
    return not any(busy)


def test_killing_one_decode_rank_mid_transfer_leaves_no_partial_install_and_no_leak(tp_stack, references):
    """SIGKILL decode rank 1 while chunks are landing: the client gets a clean error (or, had the
    transfer finished, the exact answer), the prefill node frees every push and block, and the
    decode node, restarted, installs the same prompt whole on both ranks with nothing recomputed."""
    handle, p_tp, d_tp, _dump = tp_stack
    if (p_tp, d_tp, handle.cfg.transport.backend.value) != FAULT_STACK:
        pytest.skip("runs on one stack (it kills a decode rank)")
    case = next(c for c in CASES if c.name == "c1800")              # 8 chunks, 0.4 s each on P
    stack, client = handle.stack, openai_client(handle.router_url)
    rid, outcome = f"slowpush-{uuid.uuid4().hex[:6]}", {}

    def send() -> None:
        try:
            outcome["text"] = run_case(client, case, rid)[0]
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome["error"] = exc
    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 120
    while not any(e["event"] == "install" for e in handle.events(rid)):     # a chunk has landed on D
        assert time.monotonic() < deadline and sender.is_alive(), f"no chunk installed: {outcome}"
        time.sleep(0.05)
    os.kill(_worker_pid(stack.procs["decode0"].pid, "Worker_TP1"), signal.SIGKILL)
    sender.join(120)
    assert not sender.is_alive(), "the client still waits 120 s after a decode rank died"
    if "text" in outcome:
        assert outcome["text"] == references[2][case.name], outcome
    else:
        assert isinstance(outcome["error"], openai.APIError), repr(outcome["error"])
    # vLLM takes the whole engine down with one rank: no rank goes on with half a request's KV
    assert not _healthy(stack.url(stack.specs[1]), 30), "the decode node still serves with a dead rank"
    deadline = time.monotonic() + 60
    while not _prefill_idle(handle):
        assert time.monotonic() < deadline, "the prefill node still holds pushes, requests or KV 60 s later"
        time.sleep(0.5)
    stack.kill("decode0")                                          # whatever is left of the node
    stack.restart("decode0")
    deadline = time.monotonic() + 60
    while True:                      # the router puts it back in rotation; a short request warms it up
        try:
            run_case(client, CASES[0], f"tp-warm-{uuid.uuid4().hex[:6]}")
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the restarted decode node never served"
            time.sleep(1)
    rid2 = f"tp-after-{uuid.uuid4().hex[:6]}"
    text = run_case(client, case, rid2)[0]
    assert text == references[2][case.name]
    loads = _loads(handle, rid2, d_tp)
    assert len(loads) == d_tp and all(d["recomputed_tokens"] == 0 and not d["failed"] for d in loads), loads
    deadline = time.monotonic() + 30                               # and the restarted node holds nothing after
    while True:
        m = without_vllm_labels(scrape(f"{stack.url(stack.specs[1])}/metrics"))
        held = {k: v for k, v in m.items() if k.startswith(("kvrelay_pool_slots_busy", "kvrelay_receiver_entries",
                                                             "kvrelay_transfers_inflight")) and v}
        if not held:
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.5)
