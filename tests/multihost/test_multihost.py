"""Prefill, decode and the router on three hosts: network namespaces joined by a bridge.

Each role runs in its own network namespace with its own address (``10.77.0.11`` prefill,
``.12`` decode, ``.13`` router) on a veth pair into a bridge in the root namespace, where
the test client sits (``10.77.0.1``). Nothing is reachable over loopback between them,
so every byte of HTTP, control plane and KV crosses a real (virtual) network link.

Each node is started the way an operator starts one pool per host: ``kvrelay serve``
(what ``deploy/launch_*_pool.sh`` run) and ``kvrelay router``, from one YAML file, with
the host-specific settings as flags. The decode node binds every address (``0.0.0.0``)
and announces the one its peers reach (``transport.advertise_host``), as it would in a
pod or behind NAT. UCX is limited to TCP over the namespace's interface, so nixl cannot
take a shared-memory shortcut between the "hosts".

Answers must be token-identical to the plain vLLM reference (``tests/e2e/harness.py``; at
the decode node's TP, one core per rank), and every prompt's KV must have been loaded from
pushes, not recomputed. Besides one-rank engines, it runs mixed tensor parallelism across the
hosts: TP2 prefill -> TP1 decode over tcp; with ``--matrix`` also TP1 -> TP2 over nixl and TP2 ->
TP2 over tcp.

Needs root (``ip netns``); without it the test skips and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvrelay.deploy import launch
from tests.e2e.harness import (
    CASES,
    EAGER,
    MODEL,
    PlainServers,
    openai_client,
    read_events,
    reference_at_tp,
    run_case,
    stop_active,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NET = "10.77.0"
ADDR = {"prefill": f"{NET}.11", "decode": f"{NET}.12", "router": f"{NET}.13"}
BRIDGE = "kvrbr0"
PORT = {"prefill": 18400, "decode": 18401, "router": 18450, "kv": 18410}


def _ip(*args: str, ns: str = "") -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _teardown_net() -> None:
    for role in ADDR:
        subprocess.run(["ip", "netns", "del", f"kvr-{role}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def _make_net() -> None:
    _teardown_net()                                   # a previous run killed mid-way
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for role, addr in ADDR.items():
        ns, veth = f"kvr-{role}", f"kvr-{role[:3]}"
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "kvr0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        _ip("addr", "add", f"{addr}/24", "dev", "kvr0", ns=ns)
        _ip("link", "set", "kvr0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("the multi-host test creates network namespaces: it needs root")
    if shutil.which("ip") is None:
        pytest.skip("the multi-host test needs iproute2's `ip` (apt-get install iproute2)")
    try:
        _make_net()
    except subprocess.CalledProcessError as exc:
        _teardown_net()
        pytest.skip(f"cannot create network namespaces and veth pairs here: {exc.stderr.strip()}")
    try:
        yield ADDR
    finally:
        _teardown_net()


class Hosts:
    """One node per namespace, started from one YAML file plus per-host flags."""

    def __init__(self, tmp: Path, tiny_model: Path, backend: str, p_tp: int = 1, d_tp: int = 1) -> None:
        self.tmp, self.procs, self.p_tp, self.d_tp = tmp, {}, p_tp, d_tp
        self.events = tmp / "events.jsonl"
        self.config = tmp / "kvrelay.yaml"
        d = f"http://{ADDR['decode']}:{PORT['decode']}=tcp://{ADDR['decode']}:{PORT['kv']}"
        self.config.write_text(yaml.safe_dump({
            "engine": {"model": str(tiny_model), "served_model_name": MODEL, "prefill_tp": p_tp, "decode_tp": d_tp,
                       "extra_args": list(EAGER)},         # as every engine the tests start (harness.EAGER)
            "transport": {"backend": backend},
            "deploy": {"kv_base_port": PORT["kv"], "startup_timeout_s": 900},
            "connector": {"events_path": str(self.events), "first_chunk_s": 20},
            "router": {"host": ADDR["router"], "port": PORT["router"], "health_interval_s": 0.5,
                       "prefill": [f"http://{ADDR['prefill']}:{PORT['prefill']}"], "decode": [d],
                       "tokenizer": str(tiny_model)},
        }))

    def _spawn(self, role: str, argv: list[str], core: str) -> None:
        env = dict(os.environ, UCX_NET_DEVICES="kvr0", UCX_TLS="tcp,self", VLLM_CPU_OMP_THREADS_BIND=core,
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        log = open(self.tmp / f"{role}.log", "w")  # noqa: SIM115 - owned by the child
        cmd = ["ip", "netns", "exec", f"kvr-{role}", sys.executable, "-m", "kvrelay.cli", *argv,
               "--config", str(self.config)]
        self.procs[role] = launch.spawn_group(cmd, env, log)

    def start(self) -> None:
        self._spawn("prefill", ["serve", "--role", "prefill", "--index", "0", "--port", str(PORT["prefill"]),
                                "--deploy.host", ADDR["prefill"]], "|".join(["0", "1"][:self.p_tp]))
        self._spawn("decode", ["serve", "--role", "decode", "--index", "0", "--port", str(PORT["decode"]),
                               "--deploy.host", "0.0.0.0", "--transport.advertise_host", ADDR["decode"]],
                    "|".join(["1", "0"][:self.d_tp]))
        for role in ("prefill", "decode"):
            launch.wait_healthy(f"http://{ADDR[role]}:{PORT[role]}", self.procs[role], 900,
                                str(self.tmp / f"{role}.log"))
        self._spawn("router", ["router"], "0")
        launch.wait_healthy(f"http://{ADDR['router']}:{PORT['router']}", self.procs["router"], 60,
                            str(self.tmp / "router.log"))

    def stop(self) -> None:
        for p in self.procs.values():
            launch.stop_group(p)


SETUPS = [("tcp", 1, 1), ("nixl", 1, 1), ("tcp", 2, 1), ("nixl", 1, 2), ("tcp", 2, 2)]   # (backend, P TP, D TP)
MATRIX = {("nixl", 1, 2), ("tcp", 2, 2)}          # run with --matrix (the suite runs TP2 -> TP1 across hosts)


@pytest.fixture(scope="module", ids=[f"{b}-p{p}d{d}" for b, p, d in SETUPS],
                params=[pytest.param(s, marks=pytest.mark.matrix if s in MATRIX else ()) for s in SETUPS])
def multihost(request: pytest.FixtureRequest, hosts: dict[str, str], tiny_model: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    stop_active()                      # an earlier module's stack would compete for the two cores
    backend, p_tp, d_tp = request.param
    h = Hosts(tmp_path_factory.mktemp(f"multihost-{backend}-{p_tp}{d_tp}"), tiny_model, backend, p_tp, d_tp)
    if d_tp == 2 and not _TP2_REFERENCE:     # one vLLM at the decode node's TP, before the nodes start
        _TP2_REFERENCE.update(reference_at_tp(tiny_model, h.tmp, 2, CASES))
    try:
        h.start()
        yield h
    finally:
        h.stop()


_TP2_REFERENCE: dict[str, str] = {}


def test_three_hosts_are_token_exact_and_load_from_pushes(multihost: Hosts, reference: dict[str, str]) -> None:
    want = reference if multihost.d_tp == 1 else _TP2_REFERENCE
    client = openai_client(f"http://{ADDR['router']}:{PORT['router']}")
    for case in CASES:
        rid = f"mh-{case.name}-{uuid.uuid4().hex[:6]}"
        text, usage = run_case(client, case, rid)
        assert text == want[case.name], f"{case}: output over three hosts differs from one vLLM"
        deadline = time.monotonic() + 30
        while len(done := [e for e in read_events(multihost.events)
                           if e["event"] == "load_done" and rid in e.get("transfer", "")]) < multihost.d_tp:
            assert time.monotonic() < deadline, f"{case.name}: {len(done)} load_done events of {multihost.d_tp}"
            time.sleep(0.1)
        for d in done:                                   # every decode rank loaded its heads
            assert d["recomputed_tokens"] == 0 and not d["failed"], d
            assert d["loaded_tokens"] > 0, d


CUT_S, CUTS_AT, TRAFFIC_S = 15.0, (30.0, 70.0), 110.0   # 25 s to recover after the second cut


def test_a_cut_link_between_p_and_d_loses_no_request(multihost: Hosts, plain: PlainServers,
                                                     request: pytest.FixtureRequest) -> None:
    """The soak's ``P-D link cut`` fault, which needs hosts of their own: mixed traffic through the
    router while the prefill host's link is set down for 15 s, twice (``ip link set kvr0 down``
    in its namespace: P is cut from D and from the router; nothing is closed, packets just stop).
    Every greedy answer that completes equals one vLLM's, none hangs past the client timeout or
    is lost without an error, and the recovery row is printed (docs/lab/soak.md)."""
    import asyncio

    from kvrelay.bench import soak, soak_report
    from kvrelay.bench.soak_faults import FaultKind, Injection
    from kvrelay.bench.soak_traffic import End, Load, Mix, prompt_pool

    backend = yaml.safe_load(multihost.config.read_text())["transport"]["backend"]
    if (multihost.p_tp, multihost.d_tp) != (1, 1):
        pytest.skip("the link is cut under the one-rank hosts")
    if backend != "tcp" and not request.config.getoption("--matrix"):
        pytest.skip("CI cuts the link under tcp; --matrix under nixl too (docs/lab/soak.md)")
    pool = prompt_pool(24, seed=5)
    with plain.use(2) as urls:             # plain vLLM, one pinned thread like each engine
        want = soak.answers(urls, pool)
    load = Load(f"http://{ADDR['router']}:{PORT['router']}", MODEL, pool, Mix(stall=0.0), 6, timeout_s=120)

    async def run() -> tuple[list, list[Injection], float, float]:
        clock = time.monotonic
        t0 = clock()
        traffic = asyncio.create_task(load.run(t0 + TRAFFIC_S))
        cuts = []
        for at in CUTS_AT:
            await asyncio.sleep(max(0.0, t0 + at - clock()))
            cut = clock()
            await asyncio.to_thread(_ip, "link", "set", "kvr0", "down", ns="kvr-prefill")
            await asyncio.sleep(CUT_S)
            await asyncio.to_thread(_ip, "link", "set", "kvr0", "up", ns="kvr-prefill")
            cuts.append(Injection(FaultKind.LINK_CUT, cut, clock(), f"prefill's link down {CUT_S:g} s"))
        return await traffic, cuts, t0, clock()

    outcomes, cuts, t0, t1 = asyncio.run(run())
    baseline = soak_report.rate(outcomes, t0 + 10, t0 + CUTS_AT[0])
    row = soak_report.recovery_matrix(outcomes, cuts, want, baseline, t1)[0].row()
    ex = soak_report.exactness(outcomes, want)
    print(f"link cut over {backend}: {row}; {ex['greedy_completed']} greedy answers, ends {soak_report.ends(outcomes)}")
    assert ex["differences"] == 0, ex["examples"]
    assert not [o.row() for o in outcomes if o.end in (End.HUNG, End.LOST)], soak_report.ends(outcomes)
    assert row["in_flight"] > 0 and ex["greedy_completed"] > 50, row
