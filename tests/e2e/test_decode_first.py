"""Decode-first routing (router/decide.py) on real vLLM engines and their own KV events.

- The router's index against what an engine really holds: one plain vLLM with a small KV
  cache publishes its events to a :class:`~kvrelay.router.kv_events.KVEvents` bound here;
  after eviction, ``/reset_prefix_cache`` and a SIGKILL + restart, the index's claim for a
  prompt equals the engine's own count of cached prompt tokens for it
  (``usage.prompt_tokens_details.cached_tokens``), read right after the claim. (vLLM
  publishes after each engine step, so a reset reaches the index with the next step.)
- A 1P2D stack with ``router.decode_first``: every case and a two-turn conversation answer as
  one vLLM does on both paths (D alone when at most ``disagg_min_tokens`` are left, a transfer
  otherwise); a repeated prompt or the next turn goes back to the decode node holding it, alone.
- With one decode node's events publisher killed (a real forwarding process, SIGKILLed), the
  router forgets what that node holds and places by load and length alone; answers stay exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvrelay.deploy import launch
from kvrelay.router.kv_events import KVEvents
from kvrelay.router.kv_index import KVIndex
from kvrelay.router.pools import Node
from tests.e2e.harness import CASES, MODEL, TURN1, _cfg, retire, run_case, run_turn2, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PORT0 = 22500                  # clear of the other stacks' ports (test_tp: 21000-22200)
ENGINE_PORT = 22480            # the index test's single engine
BLOCKS = 33                    # vLLM's smallest cache for a 4,096-token context: 33 x 128 tokens


def _complete(url: str, prompt: str, max_tokens: int = 1) -> dict:
    body = {"model": "kvrelay-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _cached(url: str, prompt: str) -> int:
    """The engine's own count of ``prompt``'s tokens it found in its prefix cache."""
    usage = _complete(url, prompt)["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class FollowedEngine:
    """One plain vLLM whose KV events go to an index followed on a thread's event loop."""

    def __init__(self, tiny_model: Path, tmp: Path, events_port: int) -> None:
        self.index = KVIndex()
        self.url = f"http://127.0.0.1:{ENGINE_PORT}"
        self.endpoint = f"tcp://127.0.0.1:{events_port}"
        self.tiny_model, self.tmp, self.proc = tiny_model, tmp, None
        self.loop = asyncio.new_event_loop()
        self.events = KVEvents(self.index, {self.url: self.endpoint})
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._call(lambda: self.events.sync([Node(self.url)]))

    def _call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def start(self) -> None:
        cfg = _cfg(self.tiny_model, self.tmp, ENGINE_PORT)
        cmd = launch.server_command(cfg, launch.NodeSpec(launch.Role.SINGLE, 0, ENGINE_PORT))
        cmd += ["--num-gpu-blocks-override", str(BLOCKS), "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": self.endpoint})]
        env = {**launch.server_env(cfg, 0, 2), "VLLM_SERVER_DEV_MODE": "1"}      # for /reset_prefix_cache
        with open(self.tmp / "engine.log", "a") as log:
            self.proc = launch.spawn_group(cmd, env, log)
        launch.wait_healthy(self.url, self.proc, 900, str(self.tmp / "engine.log"))
        self.wait_connected()

    def wait_connected(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.url not in self.events.connected:
            assert time.monotonic() < deadline, "the engine's publisher never connected"
            time.sleep(0.05)

    def settle(self) -> None:
        """Until no batch has arrived for 0.5 s: the events of the last step are in."""
        last = -1
        while (n := self._call(lambda: self.index.stats.batches)) != last:
            last = n
            time.sleep(0.5)

    def claim(self, prompt_ids: list[int]) -> int:
        return self._call(lambda: self.index.held(prompt_ids, [self.url])).get(self.url, 0)

    def stop(self) -> None:
        if self.proc is not None:
            launch.stop_group(self.proc)
        asyncio.run_coroutine_threadsafe(self.events.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _ids(tiny_model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(tiny_model))(text).input_ids)


def test_the_index_never_claims_what_the_engine_no_longer_holds(tiny_model, tmp_path):
    engine = FollowedEngine(tiny_model, tmp_path, PORT0 + 990)
    prompts = [f"{i} " + "".join(chr(97 + (i * 7 + k * 3) % 26) for k in range(997)) for i in range(6)]
    ids = [_ids(tiny_model, p) for p in prompts]
    try:
        engine.start()

        def check(i: int) -> int:
            """The claim for prompt i, read before the engine counts what it really holds."""
            engine.settle()
            claim = engine.claim(ids[i])
            assert claim == _cached(engine.url, prompts[i]), (i, claim)
            return claim

        _complete(engine.url, prompts[0])
        assert check(0) == len(ids[0]) // 128 * 128           # all its full blocks
        for i in range(1, 6):                                  # 6 x 8 blocks through a 33-block cache
            _complete(engine.url, prompts[i])
        assert check(0) < len(ids[0]) // 128 * 128             # evicted, and the claim followed
        check(5)
        engine.settle()
        with urllib.request.urlopen(urllib.request.Request(f"{engine.url}/reset_prefix_cache", method="POST"),
                                    timeout=30) as r:
            assert r.status == 200
        _complete(engine.url, "x")          # vLLM publishes the AllBlocksCleared with its next step's events
        assert check(5) == 0
        check(5)                                               # and what the check itself stored
        os.killpg(engine.proc.pid, signal.SIGKILL)             # restart: the old claims die with the connection
        engine.proc.wait(30)
        deadline = time.monotonic() + 30
        while engine.claim(ids[5]):
            assert time.monotonic() < deadline, "the index kept a dead engine's blocks"
            time.sleep(0.1)
        engine.start()
        assert check(5) == 0
        assert check(5) == len(ids[5]) // 128 * 128            # rebuilt from the new publisher's events
    finally:
        engine.stop()


# ---------------------------------------------------------------------- a 1P2D decode-first stack
DISAGG_MIN = 300


def _forwarder(engine_endpoint: str, pub_endpoint: str, log: Path | None = None) -> subprocess.Popen:
    """A process between an engine's publisher and the router: subscribes to the endpoint the
    engine binds and republishes every message on one it binds for the router. Killing it kills
    the publisher the router sees while the engine itself runs on."""
    code = (f"import zmq; c = zmq.Context(); s = c.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b''); "
            f"s.connect('{engine_endpoint}'); p = c.socket(zmq.PUB); p.bind('{pub_endpoint}'); "
            f"zmq.proxy(s, p)")
    out = open(log, "ab") if log else subprocess.DEVNULL        # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=out, stderr=out)


@pytest.fixture(scope="module")
def df_stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode-first")
    over: dict[str, Any] = {"deploy__decode": 2, "transport__backend": "tcp", "router__decode_first": True,
                            "router__disagg_min_tokens": DISAGG_MIN, "router__disagg_min_tokens_idle": DISAGG_MIN, "router__expose_nodes": True}
    cfg = _cfg(tiny_model, tmp, PORT0, **over)
    stack = launch.Stack(cfg)
    specs = stack.specs
    # decode1's events reach the router through a forwarder (killed by the last test)
    engines = {s.name: launch.kv_events_endpoint(stack.cfg, s) for s in specs}
    routed = {**engines, "decode1": f"ipc://{tmp}/forwarded-decode1.sock"}
    over["router__kv_events"] = [f"{stack.url(s)}={routed[s.name]}" for s in specs]
    handle = start_stack(tiny_model, tmp, PORT0, **over)
    fwd = _forwarder(engines["decode1"], routed["decode1"], tmp / "forwarder.log")
    deadline = time.monotonic() + 60                # the router follows every engine's events first
    while sum(v for k, v in _counters(handle.router_url).items()
              if k.startswith("kvrelay_router_kv_events_following")) < len(specs):
        assert time.monotonic() < deadline, "the router never followed every engine's KV events"
        time.sleep(0.2)
    time.sleep(1.0)                                 # the forwarder's own subscription to decode1
    yield handle, fwd, {stack.url(s): s.name for s in specs}
    fwd.kill()
    retire(handle.stack)


def _counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in lines if ln.startswith("kvrelay_router_"))}


class Placed:
    """An OpenAI client through the router that remembers where each answer was computed
    (``router.expose_nodes``: X-Kvrelay-Decode, and X-Kvrelay-Prefill when a prefill node ran)."""

    def __init__(self, url: str) -> None:
        import httpx
        import openai

        self.headers: dict[str, str] = {}
        hook = lambda r: self.headers.update(decode=r.headers.get("X-Kvrelay-Decode", ""),  # noqa: E731
                                             prefill=r.headers.get("X-Kvrelay-Prefill", ""))
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0,
                                    http_client=httpx.Client(event_hooks={"response": [hook]}))

    def case(self, case: Any) -> tuple[str, int, str, str]:
        """(answer, prompt tokens, decode node, prefill node or "")."""
        text, usage = run_case(self.client, case)
        return text, usage["prompt_tokens"] if usage else 0, self.headers["decode"], self.headers["prefill"]


def test_every_case_is_exact_and_a_repeat_goes_back_to_its_decode_node_alone(df_stack, reference):
    handle, _, names = df_stack
    placed = Placed(handle.router_url)
    homes = set()
    for case in CASES:
        first, n, d1, p1 = placed.case(case)
        assert first == reference[case.name], f"{case.name}: differs from one vLLM ({'D alone' if not p1 else 'P+D'})"
        assert (not p1) == (n <= DISAGG_MIN), (case.name, n, p1)     # nothing held yet: the prompt decides
        again, _, d2, p2 = placed.case(case)
        assert again == first, f"{case.name}: the repeat differs"
        assert not p2, (case.name, p2)                      # alone: what is left is short either way
        if n >= 128:                                          # a whole block cached: back where it is
            assert d2 == d1, (case.name, names.get(d1), names.get(d2))
        homes.add(names.get(d1))
    assert homes == {"decode0", "decode1"}, homes             # new prompts spread; only held ones stick
    c = _counters(handle.router_url)
    assert c[f'kvrelay_router_decisions_total{{model_name="{MODEL}",path="decode_only"}}'] >= len(CASES)
    assert c[f'kvrelay_router_cached_prompt_tokens_total{{model_name="{MODEL}",role="decode"}}'] > 0


def test_the_next_turn_lands_where_its_history_is(df_stack, reference):
    handle, _, _ = df_stack
    placed = Placed(handle.router_url)
    answer1, n1, d1, _ = placed.case(TURN1)
    assert answer1 == reference["turn1"]
    before = _counters(handle.router_url)[f'kvrelay_router_cached_prompt_tokens_total{{model_name="{MODEL}",role="decode"}}']
    assert run_turn2(placed.client, reference["turn1"]) == reference["turn2"]
    assert placed.headers["decode"] == d1                  # where turn 1's prompt and answer are cached
    gained = _counters(handle.router_url)[f'kvrelay_router_cached_prompt_tokens_total{{model_name="{MODEL}",role="decode"}}'] - before
    assert gained >= n1 // 128 * 128, (gained, n1)


def test_a_killed_events_publisher_leaves_load_only_routing_and_exact_answers(df_stack, reference):
    handle, fwd, names = df_stack
    placed = Placed(handle.router_url)
    held = [c for c in CASES if c.prompt_len > DISAGG_MIN]
    on_d1 = [c for c in held if names.get(placed.case(c)[2]) == "decode1"]
    assert on_d1, "no case was placed on decode1"
    fwd.kill()                                        # decode1's publisher, as the router sees it, is gone
    fwd.wait(10)
    time.sleep(1.0)
    before = _counters(handle.router_url)
    for case in on_d1:
        text, n, _, p_node = placed.case(case)
        assert text == reference[case.name], case.name
        assert p_node, f"{case.name}: with decode1's blocks forgotten, {n} tokens are left: P computes them"
    after = _counters(handle.router_url)
    key = f'kvrelay_router_cached_prompt_tokens_total{{model_name="{MODEL}",role="decode"}}'
    assert after[key] == before[key]                  # nothing of decode1 is claimed any more
