"""Decode-first placement (router/decide.py) through the real router, real ZeroMQ and real HTTP:
scripted engines answer, and publishers send batches encoded by vLLM's own event classes to the
endpoints the router binds, as a vLLM engine started with ``--kv-events-config`` does."""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq

from kvrelay.core import config as kcfg
from kvrelay.router.app import Router
from kvrelay.router.pools import Node, Pool
from tests.router.test_router import Fake, fake_node, run, serve

ev = pytest.importorskip("vllm.distributed.kv_events")
BS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Publisher:
    """One engine's publisher: connects to the router's endpoint (or, as vLLM does with a
    wildcard address, binds it) and sends [topic, seq, batch]."""

    def __init__(self, endpoint: str, bind: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.seq = 0

    def store(self, tokens: list[int]) -> None:
        n = len(tokens) // BS
        batch = ev.KVEventBatch(ts=0.0, events=[ev.BlockStored(
            block_hashes=[self.seq * 1000 + i for i in range(n)], parent_block_hash=None,
            token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)])
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


@asynccontextmanager
async def decode_first(tiny_model: Any, n_d: int = 2, **router: Any):
    """One scripted P, ``n_d`` scripted Ds, the router with decode_first and a KV endpoint per D."""
    p, ds = Fake(), [Fake() for _ in range(n_d)]
    async with fake_node(p) as _, fake_node(ds[0]), fake_node(ds[1]) if n_d > 1 else fake_node(Fake()):
        ends = [f"tcp://127.0.0.1:{free_port()}" for _ in ds]
        cfg = kcfg.from_dict({"router": {
            "decode_first": True, "tokenizer": str(tiny_model), "first_token": "decode", "health_interval_s": 0.2,
            "kv_events": [f"{d.url}={e}" for d, e in zip(ds, ends, strict=True)], **router}})
        pool_p = Pool("prefill", [Node(p.url)], cfg.router.policy)
        pool_d = Pool("decode", [Node(d.url, f"tcp://127.0.0.1:{9100 + i}") for i, d in enumerate(ds)],
                      cfg.router.policy)
        r = Router(cfg, pool_p, pool_d, secret=b"k" * 32)
        async with serve(r.app()) as url, aiohttp.ClientSession() as s:
            while not all(n.healthy for n in pool_p.nodes + pool_d.nodes):
                await asyncio.sleep(0.05)
            pubs = [Publisher(e) for e in ends]
            await until(lambda: len(r.kv_events.connected) == len(ds))    # a PUB drops what it sends before
            try:
                yield url, s, r, p, ds, pubs
            finally:
                for pub in pubs:
                    pub.close()


async def until(check: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def metric(s: aiohttp.ClientSession, url: str, line: str) -> bool:
    async with s.get(f"{url}/metrics") as r:
        return line in await r.text()


PROMPT = list(range(1, 601))          # 600 tokens: 4 full blocks of 128 (512 tokens) and 88 more


def test_the_node_holding_the_prompt_serves_it_alone_when_little_is_left(tiny_model):
    async def go() -> None:
        async with decode_first(tiny_model, disagg_min_tokens=100, disagg_min_tokens_idle=100) as (url, s, r, p, ds, pubs):
            pubs[1].store(PROMPT)
            await until(lambda: r.decide.index.held(PROMPT, [ds[1].url]) == {ds[1].url: 512})
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": PROMPT}) as resp:
                assert resp.status == 200
            assert len(ds[1].requests) == 1 and not ds[0].requests and not p.requests   # no prefill hop
            assert "kv_transfer_params" not in ds[1].requests[0]
            assert await metric(s, url, 'kvrelay_router_decisions_total{model_name="kvrelay-tiny",path="decode_only"} 1.0')
            assert await metric(s, url, 'kvrelay_router_cached_prompt_tokens_total{model_name="kvrelay-tiny",role="decode"} 512.0')
            # a prompt no node holds: more than 100 tokens to compute, so a prefill node computes it
            other = [7] * 600
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": other}) as resp:
                assert resp.status == 200
            await until(lambda: p.requests)   # P's prefill is a background task beside D's answer
            assert len(p.requests) == 1 and "kv_transfer_params" in p.requests[0]
            assert await metric(s, url, 'kvrelay_router_decisions_total{model_name="kvrelay-tiny",path="disaggregated"} 1.0')
    run(go())


def test_a_busy_holder_loses_the_turn_and_a_lost_publisher_leaves_load_only_routing(tiny_model):
    async def go() -> None:
        async with decode_first(tiny_model, disagg_min_tokens=100, disagg_min_tokens_idle=100, decode_request_tokens=256) as (
                url, s, r, p, ds, pubs):
            pubs[1].store(PROMPT)
            await until(lambda: r.decide.index.held(PROMPT, [ds[1].url]))
            busy = r.decode.nodes[1]
            busy.outstanding = 3          # 88 + 3 x 256 tokens of work there > 600 on the idle node
            placed = r.decide.place(PROMPT)
            assert placed.decode.url == ds[0].url and placed.decode_held == 0
            busy.outstanding = 0
            assert r.decide.place(PROMPT).decode.url == ds[1].url
            pubs[1].close()               # the publisher goes away: its claims go with it
            await until(lambda: not r.decide.index.held(PROMPT, [ds[1].url]))
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": PROMPT}) as resp:
                assert resp.status == 200
            await until(lambda: p.requests)   # P's prefill is a background task beside D's answer
            assert len(p.requests) == 1   # 600 tokens to compute wherever it lands: disaggregated
    run(go())


def test_requests_that_cannot_be_tokenised_or_must_go_alone_are_counted(tiny_model):
    async def go() -> None:
        async with decode_first(tiny_model, n_d=1) as (url, s, r, p, ds, pubs):
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "n": 2}) as resp:
                assert resp.status == 200
            assert await metric(s, url, 'kvrelay_router_decisions_total{model_name="kvrelay-tiny",path="decode_required"} 1.0')
            async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi"}) as resp:
                assert resp.status == 200     # 2 tokens: at most disagg_min_tokens, D alone
            assert await metric(s, url, 'kvrelay_router_decisions_total{model_name="kvrelay-tiny",path="decode_only"} 1.0')
            assert not p.requests
    run(go())


def test_kvrelay_up_gives_every_engine_a_private_events_socket_it_binds_and_the_router_connects(tmp_path):
    """Each engine binds ``ipc://<runtime_dir>/kv-events-<node>.sock`` (vLLM binds ipc endpoints)
    and the router connects to it. Before, the router bound a TCP port on 127.0.0.1 that any
    local user could bind first (then receiving every prompt's token ids) or connect to (then
    publishing forged events)."""
    from kvrelay.deploy.config_check import stack_ports
    from kvrelay.deploy.launch import Stack, server_command

    run = tmp_path / "run"
    data = {"deploy": {"prefill": 2, "decode": 2, "kv_base_port": 9100}, "router": {"decode_first": True},
            "engine": {"model": "/nonexistent"}, "connector": {"runtime_dir": str(run)}}
    stack = Stack(kcfg.from_dict(data), log_dir="/tmp/kvrelay-test-events")
    events = stack.router_config().router.kv_events
    ends = [e.split("=", 1)[1] for e in events]
    assert ends == [f"ipc://{run}/kv-events-{s.name}-{s.port}.sock" for s in stack.specs]
    assert run.stat().st_mode & 0o777 == 0o700
    for spec, end in zip(stack.specs, ends, strict=True):
        cmd = server_command(stack.cfg, spec)
        conf = cmd[cmd.index("--kv-events-config") + 1]
        assert end in conf and '"publisher": "zmq"' in conf
    assert len(set(stack_ports(stack.cfg).values())) == len(stack_ports(stack.cfg))
    with pytest.raises(kcfg.ConfigError, match="router.kv_events"):
        kcfg.from_dict({"router": {"kv_events": ["tcp://127.0.0.1:1"]}})


def test_decode_first_is_the_default_wherever_the_router_follows_the_engines_kv_events(tiny_model, tmp_path):
    """``router.decode_first`` defaults to auto: ``kvrelay up`` (and ``deploy k8s``) wires the
    engines' KV events and the tokenizer, so the router it starts places decode-first; a router
    given neither places by load, and says why; true and false decide whatever else is set."""
    from kvrelay.deploy.launch import Stack
    from kvrelay.router.decide import switched_on

    def on(**router: Any) -> bool:
        return switched_on(kcfg.from_dict({"router": router}).router)[0]

    assert kcfg.from_dict({}).router.decode_first is None
    for text, want in (("auto", None), ("true", True), ("false", False)):
        assert kcfg.load(overrides=[f"router.decode_first={text}"]).router.decode_first is want
    assert not on() and not on(kv_events_port=9401)                       # no events; no tokenizer
    assert on(kv_events_port=9401, tokenizer=str(tiny_model)) and on(decode_first=True)
    assert not on(decode_first=False, kv_events_port=9401, tokenizer=str(tiny_model))
    data = {"deploy": {"decode": 2, "kv_base_port": 9100}, "engine": {"model": str(tiny_model)},
            "connector": {"runtime_dir": str(tmp_path / "run")}}
    rc = Stack(kcfg.from_dict(data), log_dir=str(tmp_path / "logs")).router_config()
    assert rc.router.decode_first is None and len(rc.router.kv_events) == 3 and switched_on(rc.router)[0]
    router = Router(rc, secret=b"k" * 32)
    assert router.decide is not None and router.kv_events is not None
    off = Stack(kcfg.from_dict({**data, "router": {"decode_first": False}}), log_dir=str(tmp_path / "logs"))
    assert not off.router_config().router.kv_events and Router(off.router_config(), secret=b"k" * 32).decide is None


def test_an_oversize_events_frame_is_refused_unread_and_the_engine_followed_again(tmp_path):
    """A 64 MiB frame on an engine's events socket ends that connection before it is read (before
    the fix it was taken whole and decoded on the router's event loop); the index keeps what it
    had, and the publisher's next batches are followed again."""
    from kvrelay.router.kv_events import KVEvents
    from kvrelay.router.kv_index import KVIndex

    async def go() -> None:
        end, url = f"ipc://{tmp_path}/events.sock", "http://127.0.0.1:1"
        index, states = KVIndex(), []
        events = KVEvents(index, {url: end}, report=lambda u, on: states.append(on))
        pub = Publisher(end, bind=True)                  # the engine binds, the router connects
        try:
            events.sync([Node(url)])
            await until(lambda: url in events.connected)
            await until(lambda: index.held(PROMPT, [url]) == {url: 512} or pub.store(PROMPT))   # slow joiner
            pub.sock.send_multipart([b"", (99).to_bytes(8, "big"), b"\x00" * (64 << 20)])
            await until(lambda: not index.held(PROMPT, [url]))          # dropped: its claims forgotten
            await until(lambda: url in events.connected)                  # ZeroMQ reconnects
            pub.seq = 0
            await until(lambda: index.held(PROMPT, [url]) == {url: 512} or pub.store(PROMPT))
            assert states[0] is True and False in states and states[-1] is True
        finally:
            pub.close()
            await events.stop()
    run(go())


def test_an_events_endpoint_the_router_cannot_bind_is_visible_and_routes_by_load():
    """Someone else holds the TCP port the router should bind for an engine's events: the router
    logs it, reports that engine not followed (kvrelay_router_kv_events_following 0) and claims
    nothing for it."""
    from kvrelay.router.kv_events import KVEvents
    from kvrelay.router.kv_index import KVIndex

    async def go() -> None:
        port = free_port()
        squatter = zmq.Context.instance().socket(zmq.PUB)
        squatter.bind(f"tcp://127.0.0.1:{port}")
        states: list[tuple[str, bool]] = []
        events = KVEvents(KVIndex(), {"http://d:1": f"tcp://127.0.0.1:{port}"},
                          report=lambda u, on: states.append((u, on)))
        try:
            events.sync([Node("http://d:1")])
            await until(lambda: bool(states))
            assert states == [("http://d:1", False)] and not events.connected
        finally:
            squatter.close(linger=0)
            await events.stop()
    run(go())


def test_an_idle_decode_node_takes_longer_prompts_than_a_busy_one(tiny_model):
    async def go() -> None:
        async with decode_first(tiny_model, disagg_min_tokens=100, disagg_min_tokens_idle=600) as (
                url, s, r, p, ds, pubs):
            from kvrelay.router.decide import RoutePath

            assert r.decide.place(PROMPT).path is RoutePath.DECODE_ONLY        # 600 tokens, nobody to stall
            for node in r.decode.nodes:
                node.outstanding = 1                                          # every D streams an answer
            assert r.decide.place(PROMPT).path is RoutePath.DISAGGREGATED
            assert r.decide.place(PROMPT[:90]).path is RoutePath.DECODE_ONLY
            for node in r.decode.nodes:
                node.outstanding = 0                                          # idle again: by default,
            assert r.decide.place(PROMPT).path is RoutePath.DECODE_ONLY        # however often arrivals overlapped
    run(go())


def test_with_an_events_port_the_router_subscribes_to_each_engine_and_follows_it_through_a_restart(tiny_model):
    """``router.kv_events_port`` (Kubernetes): the engine binds, the router connects to the pool
    member's host at that port; a publisher that goes away takes its claims along, and the
    router picks up the one that comes back on its own (ZeroMQ reconnects)."""
    async def go() -> None:
        d, p = Fake(), Fake()
        port = free_port()
        async with fake_node(p), fake_node(d):
            cfg = kcfg.from_dict({"router": {"decode_first": True, "tokenizer": str(tiny_model), "first_token": "decode",
                                             "health_interval_s": 0.2, "kv_events_port": port}})
            r = Router(cfg, Pool("prefill", [Node(p.url)], cfg.router.policy),
                       Pool("decode", [Node(d.url, "tcp://127.0.0.1:9100")], cfg.router.policy), secret=b"k" * 32)
            async with serve(r.app()):
                assert r.kv_events.endpoint(d.url) == f"tcp://127.0.0.1:{port}"
                for _ in range(2):                  # the engine, then the same engine restarted
                    pub = Publisher(f"tcp://*:{port}", bind=True)
                    try:
                        await until(lambda: d.url in r.kv_events.connected)
                        # connected is the TCP connection; ZeroMQ drops what a PUB socket sends before
                        # the subscription has reached it (its "slow joiner"), so publish until held,
                        # as an engine that keeps storing blocks does
                        await until(lambda pub=pub: r.decide.index.held(PROMPT, [d.url]) == {d.url: 512}
                                    or pub.store(PROMPT))
                    finally:
                        pub.close()
                    await until(lambda: not r.decide.index.held(PROMPT, [d.url]))
    run(go())


def test_an_idle_node_whose_requests_often_overlap_computes_only_short_prompts_alone(tiny_model):
    """Open traffic: an idle decode node that was often busy when requests arrived would make
    the next arrival wait behind a long prompt computed alone, so only the busy bound applies
    until arrivals stop overlapping. A client sending one request at a time never overlaps."""
    async def go() -> None:
        async with decode_first(tiny_model, n_d=1, disagg_min_tokens=100, disagg_min_tokens_idle=600,
                                disagg_idle_overlap=0.1) as (
                url, s, r, p, ds, pubs):
            from kvrelay.router.decide import RoutePath

            node = r.decode.nodes[0]
            for _ in range(50):                                     # one at a time: always idle on arrival
                assert r.decide.place(PROMPT).path is RoutePath.DECODE_ONLY
            for busy in [1, 0] * 4:                                 # every other request arrives during another
                node.outstanding = busy
                placed = r.decide.place(PROMPT)
            assert placed.path is RoutePath.DISAGGREGATED and node.outstanding == 0    # idle, but overlap is common
            assert r.decide.place(PROMPT[:90]).path is RoutePath.DECODE_ONLY
            paths = [r.decide.place(PROMPT).path for _ in range(40)]   # arrivals stop overlapping
            assert paths[0] is RoutePath.DISAGGREGATED and paths[-1] is RoutePath.DECODE_ONLY
    run(go())


def test_arrival_overlap_is_an_average_over_arrivals():
    from kvrelay.router.decide import ArrivalOverlap

    o = ArrivalOverlap(weight=0.5)
    assert o.note("a", True) == 0.5 and o.note("a", True) == 0.75 and o.note("a", False) == 0.375
    assert o.note("b", False) == 0.0 and len(o) == 2
    o.keep({"b"})
    assert len(o) == 1 and o.note("a", False) == 0.0


@pytest.mark.parametrize("shape", ["long-role", "many-empty-messages", "long-name", "content-parts"])
def test_a_large_chat_is_tokenised_off_the_event_loop_however_its_size_is_spread(shape):
    """The inline/thread choice bounds the work by the whole request, not by ``content`` strings
    alone: before the fix an 8 MiB ``role``, or 200k empty messages, was rendered and tokenised
    on the router's event loop, freezing every stream."""
    import threading

    from kvrelay.router.decide import DecodeFirst
    from kvrelay.router.kv_index import KVIndex

    bodies = {"long-role": [{"role": "r" * (8 << 20), "content": ""}],
              "many-empty-messages": [{"role": "user", "content": ""}] * 200_000,
              "long-name": [{"role": "user", "name": "n" * 100_000, "content": "hi"}],
              "content-parts": [{"role": "user", "content": [{"type": "text", "text": "t" * 100_000}]}]}
    body = {"model": "m", "messages": bodies[shape]}
    seen: list[bool] = []

    def tokenize(b: dict[str, Any]) -> list[int]:
        seen.append(threading.current_thread() is threading.main_thread())
        return [1, 2, 3]

    df = DecodeFirst(None, None, None, KVIndex(), tokenize)  # type: ignore[arg-type]
    assert asyncio.run(df.tokens(body)) == [1, 2, 3]
    assert seen == [False], "tokenised on the event loop's thread"
    small = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    asyncio.run(df.tokens(small))
    assert seen == [False, True]                   # a small one stays inline (cheaper than a thread)


@pytest.mark.parametrize("body", [
    {"prompt": "Once upon a time, ünïcode 中文 and spaces  "},
    {"prompt": "no special tokens", "add_special_tokens": False},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello ünï 中文"}]},
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
], ids=["completion", "completion-no-special", "chat", "chat-special"])
def test_the_router_tokenises_as_the_tokenizer_itself_does(tiny_model, body):
    """The backend fast path gives the ids transformers' own calls give (as vLLM tokenises:
    completions with special tokens unless the request says not, chats rendered then without)."""
    from kvrelay.router.cache_index import PromptTokenizer

    pt = PromptTokenizer(str(tiny_model))
    assert pt.backend is not None                       # the fast path is what is tested
    special = bool(body.get("add_special_tokens", "prompt" in body))
    if "prompt" in body:
        want = pt.tok(body["prompt"], add_special_tokens=special).input_ids
    else:
        text = pt.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        want = pt.tok(text, add_special_tokens=special).input_ids
        if not special:                                 # and as transformers tokenises a chat itself
            ids = pt.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            assert (ids if isinstance(ids, list) else ids["input_ids"]) == list(want)
    assert pt(body) == list(want) and pt(body)
