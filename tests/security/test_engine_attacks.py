"""Forged transfer params sent straight to real vLLM engines, while honest traffic flows through
the router (which needs an API key here); and the secret in no command line or log.

Each forgery gets an OpenAI-style 400 from the engine's kvrelay guard, is counted in
``kvrelay_params_refused_total{cause}`` on the engine's own ``/metrics``, and pushes
nothing; the honest requests stay token-identical to the single-server reference.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvrelay.core.params import ParamsSigner, PullParams, PushParams, params_dict
from kvrelay.deploy import launch
from tests.e2e.harness import MODEL, openai_client, read_events, run_case, scrape
from tests.e2e.routers import own_cases, reference_for, second_router

SECRET = os.environ["KVRELAY_SECRET"].encode()
API_KEY = "security-suite-key"
CASES = own_cases("security")[:8]     # prompts of this module's own (tests/e2e/routers.py)
pytestmark = [pytest.mark.chaos, pytest.mark.parametrize("pd_stack", ["tcp"], indirect=True)]


@pytest.fixture(scope="module")
def guarded(pd_stack):
    """The shared tcp stack's engines behind a router of this module's own that needs an API key."""
    with second_router(pd_stack, "guarded", pd_stack.cfg.router.port + 4, decode_first=False,
                       api_keys=[API_KEY]) as handle:
        yield handle


@pytest.fixture(scope="module")
def security_reference(plain) -> dict[str, str]:
    return reference_for(plain, CASES)


def post(url: str, body: dict, key: str = "") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def node_url(handle, role: launch.Role) -> str:
    return handle.stack.url(next(s for s in handle.stack.specs if s.role is role))


def test_forged_params_get_a_400_and_push_nothing_while_honest_requests_stay_exact(guarded, security_reference):
    p_url, d_url = node_url(guarded, launch.Role.PREFILL), node_url(guarded, launch.Role.DECODE)
    d_kv = guarded.stack.router_config().router.decode[0].split("=", 1)[1]
    honest: dict[str, str] = {}
    client = openai_client(guarded.router_url)
    client.api_key = API_KEY

    def traffic() -> None:
        for case in CASES:
            honest[case.name] = run_case(client, case)[0]
    t = threading.Thread(target=traffic)
    t.start()
    good, stale = ParamsSigner(SECRET, 60), ParamsSigner(SECRET, 60, clock=lambda: time.time() - 3600)
    push = PushParams(transfer_id="atk-push", push_to=d_kv)
    attacks = {      # name: (node, params, refusal cause)
        "unsigned": (p_url, push, "unsigned"),
        "forged": (p_url, PushParams(transfer_id="atk-forged", push_to=d_kv, exp=4e9, sig="ab" * 32), "bad_signature"),
        "expired": (p_url, stale.sign(PushParams(transfer_id="atk-expired", push_to=d_kv)), "expired"),
        "foreign": (p_url, good.sign(PushParams(transfer_id="atk-foreign", push_to="tcp://127.0.0.1:9")),
                    "not_allowed"),
        "hijack": (d_url, PullParams(transfer_id="atk-hijack"), "unsigned"),
        "hijack-forged": (d_url, PullParams(transfer_id="atk-hijack2", exp=4e9, sig="cd" * 32), "bad_signature"),
    }
    before = {url: scrape(f"{url}/metrics") for url in (p_url, d_url)}
    for name, (url, params, _cause) in attacks.items():
        status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "exfiltrate me " * 30,
                                                     "max_tokens": 2, "kv_transfer_params": params_dict(params)})
        assert status == 400, (name, status, body)
        assert body["error"]["param"] == "kv_transfer_params" and body["error"]["message"], (name, body)
    t.join(300)
    assert honest == {c.name: security_reference[c.name] for c in CASES}
    for url in (p_url, d_url):
        after = scrape(f"{url}/metrics")
        for name, (node, _, cause) in attacks.items():
            if node == url:
                key = f'kvrelay_params_refused_total{{cause="{cause}"}}'
                assert after.get(key, 0) > before[url].get(key, 0), (name, key)
    time.sleep(1)
    touched = [e for e in read_events(guarded.events_path) if "atk-" in json.dumps(e)]
    assert touched == [], touched                               # nothing pushed, nothing loaded
    assert drained(guarded), "a slot, receiver entry, engine request or KV block was left behind"
    status, _ = post(f"{guarded.router_url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status == 401                                        # the router wants its key


def drained(handle, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = handle.worker_metrics(launch.Role.DECODE)
        engines = [handle.engine_metrics(r) for r in (launch.Role.PREFILL, launch.Role.DECODE)]
        busy = [d["kvrelay_pool_slots_busy"], d["kvrelay_receiver_entries"]]
        busy += [sum(v for k, v in m.items() if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                                 "vllm:kv_cache_usage_perc"))) for m in engines]
        if not any(busy):
            return True
        time.sleep(0.5)
    return False


def test_exporters_listen_on_loopback_only(guarded):
    """``connector.metrics_host`` defaults to 127.0.0.1: the exporter's listening socket says so."""
    port = guarded.cfg.connector.metrics_port + 1            # the decode node's worker exporter
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening              # 127.0.0.1, and nothing else


def test_the_secret_is_in_no_command_line_and_no_log(guarded):
    secret = os.environ["KVRELAY_SECRET"]
    groups = {p.pid for p in guarded.stack.procs.values()}
    seen = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) not in groups:                    # process group id
                continue
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        seen += 1
        assert secret not in cmdline, f"secret on the command line of pid {stat.parent.name}"
    assert seen >= 3                                            # prefill, decode, router (and their children)
    for f in filter(Path.is_file, guarded.stack.log_dir.iterdir()):
        assert secret not in f.read_text(errors="replace"), f"secret in {f}"
    assert secret not in guarded.events_path.read_text(errors="replace")


def _as_nobody(fn) -> str:
    """Run ``fn`` in a child process as user ``nobody``; what it raised, or ""."""
    import multiprocessing

    def child(q) -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        try:
            fn()
            q.put("")
        except OSError as exc:
            q.put(type(exc).__name__)
    q: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
    p = multiprocessing.get_context("fork").Process(target=child, args=(q,))
    p.start()
    p.join(10)
    return q.get(timeout=5)


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another local user: needs root")
def test_files_planted_by_another_local_user_change_nothing(guarded, security_reference):
    """Another user plants FIFOs and malformed files where kvrelay's node files are (the private
    runtime directory refuses them) and where they used to be (/dev/shm, /tmp); a FIFO, a
    malformed name, garbage and a symlink get into the runtime directory anyway (planted as
    root). Every engine's /metrics answers within 1 s and requests through the router succeed."""
    from kvrelay.common.private_files import runtime_dir

    run = runtime_dir(guarded.cfg.connector.runtime_dir)
    assert run.stat().st_mode & 0o777 == 0o700
    gauges = sorted(run.glob("kvrelay-gauges-*.json"))
    assert gauges, f"no gauge snapshot in {run}"
    engines = {p.name.rsplit("-", 1)[0] for p in gauges}
    drains = [launch.drain_path(guarded.cfg, s) for s in guarded.stack.specs if s.role is not launch.Role.SINGLE]
    assert all(Path(d).parent == run for d in drains)
    assert _as_nobody(lambda: os.mkfifo(run / "kvrelay-gauges-x-1.json")) == "PermissionError"
    old = [Path("/dev/shm") / f"{e}-{os.getpid()}.json" for e in engines]
    old += [Path("/tmp") / f"kvrelay-{s.name}-{s.port}.drain" for s in guarded.stack.specs]
    planted = [*old, *(run / f"{e}-{os.getpid()}.json" for e in engines), run / "kvrelay-gauges-x-x.json",
               run / "kvrelay-gauges-x-7.json", *map(Path, drains)]
    try:
        for p in old:
            p.unlink(missing_ok=True)
            assert _as_nobody(lambda p=p: os.mkfifo(p)) == ""
        for p in planted[len(old):]:
            if p.name.endswith("-x.json"):
                p.write_text("{")
            elif p.name.endswith("-7.json"):
                p.symlink_to("/etc/passwd")
            else:
                os.mkfifo(p)
        for role in (launch.Role.PREFILL, launch.Role.DECODE):
            t0 = time.monotonic()
            with urllib.request.urlopen(f"{node_url(guarded, role)}/metrics", timeout=1) as r:
                assert r.status == 200 and b"kvrelay_pool_slots_busy" in r.read()
            assert time.monotonic() - t0 < 1
        client = openai_client(guarded.router_url)
        client.api_key = API_KEY
        for case in CASES[:4]:
            assert run_case(client, case)[0] == security_reference[case.name], case.name
    finally:
        for p in planted:
            p.unlink(missing_ok=True)
