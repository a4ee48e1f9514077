"""Pools from DNS (headless Services) and name-based push allowlists.

The reconcile logic runs against an injected resolver (a unit test of a state machine);
the router then runs for real with the system resolver: ``dns+http://localhost:PORT``
entries in its config, scripted engines on loopback, a real request through them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvrelay.core import config as kcfg
from kvrelay.core.params import PushAllowlist
from kvrelay.router.app import Router
from kvrelay.router.discovery import Discovery, parse_dns
from kvrelay.router.pools import Node, Pool
from tests.router.test_router import Fake, fake_node, run, serve


def test_entries_parse_and_bad_ones_say_what_is_expected():
    e = parse_dns("dns+http://kvrelay-decode.ns.svc:8000=tcp://kvrelay-decode.ns.svc:9100", decode=True)
    assert (e.host, e.port, e.side_port) == ("kvrelay-decode.ns.svc", 8000, 9100)
    n = e.node("10.1.2.3", decode=True)
    assert (n.url, n.kv_endpoint) == ("http://10.1.2.3:8000", "tcp://10.1.2.3:9100")
    assert e.node("fd00::7", decode=True).url == "http://[fd00::7]:8000"
    for bad, decode in [("dns+http://d.svc:8000", True), ("dns+ftp://d.svc:8000", False),
                        ("dns+http://d.svc:8000=tcp://other.svc:9100", True), ("dns+http://d.svc", False)]:
        with pytest.raises(ValueError, match="entry"):
            parse_dns(bad, decode)


def test_discovery_adds_new_pods_out_of_rotation_drops_gone_ones_and_survives_a_dns_outage():
    answers: dict[str, list[str] | OSError] = {"d.svc": ["10.0.0.1", "10.0.0.2"]}
    changes = []

    async def resolver(host: str, port: int) -> list[str]:
        a = answers[host]
        if isinstance(a, OSError):
            raise a
        return list(a)

    async def go() -> None:
        static = Node("http://static:1", "tcp://static:2", healthy=True)
        pool = Pool("decode", [static], kcfg.RoutingPolicy.ROUND_ROBIN, discovered=True)
        d = Discovery(pool, [parse_dns("dns+http://d.svc:8000=tcp://d.svc:9100", True)], decode=True,
                      resolver=resolver, on_change=lambda: changes.append(len(pool.nodes)))
        await d.refresh()
        assert [n.url for n in pool.nodes] == ["http://static:1", "http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        assert not pool.nodes[1].healthy                     # the health loop admits it
        pool.nodes[1].healthy, pool.nodes[1].outstanding = True, 3
        answers["d.svc"] = ["10.0.0.1", "10.0.0.3"]          # pod 2 went away, pod 3 came
        await d.refresh()
        urls = [n.url for n in pool.nodes]
        assert urls == ["http://static:1", "http://10.0.0.1:8000", "http://10.0.0.3:8000"]
        assert pool.nodes[1].outstanding == 3 and pool.nodes[1].healthy   # a node that stays keeps its state
        answers["d.svc"] = OSError("Temporary failure in name resolution")
        await d.refresh()
        assert [n.url for n in pool.nodes] == urls                         # an outage empties nothing
        await d.refresh()
        assert changes == [3, 3]
    run(go())


def test_router_serves_through_dns_discovered_pools():
    # The system resolver: "localhost" resolves to 127.0.0.1 (and perhaps ::1, where nothing
    # listens: that node must stay out of rotation).
    async def go() -> None:
        pn, dn = Fake(), Fake()
        async with fake_node(pn), fake_node(dn):
            p_port, d_port = (int(f.url.rsplit(":", 1)[1]) for f in (pn, dn))
            cfg = kcfg.from_dict({"router": {
                "prefill": [f"dns+http://localhost:{p_port}"], "first_token": "decode", "health_interval_s": 0.1,
                "decode": [f"dns+http://localhost:{d_port}=tcp://localhost:9100"], "dns_refresh_s": 0.2}})
            router = Router(cfg, secret=b"k" * 32)
            assert router.prefill.nodes == [] and router.decode.nodes == []
            async with serve(router.app()) as url, aiohttp.ClientSession() as s:
                for _ in range(100):
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.05)
                assert f"http://127.0.0.1:{d_port}" in [n.url for n in router.decode.nodes]
                assert router.decode.nodes[0].kv_endpoint == "tcp://127.0.0.1:9100"
                assert router.admission.capacity == cfg.router.max_inflight * len(router.decode.nodes)
                async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
                    assert r.status == 200 and b"[DONE]" in await r.read()
                assert len(pn.requests) == 1 and len(dn.requests) == 1
                pushed_to = pn.requests[0]["kv_transfer_params"]
                assert "127.0.0.1:9100" in str(pushed_to)
    run(go())


def test_cache_aware_routing_follows_dns_discovered_prefill_pods_and_their_store_events(tiny_model):
    # Two prefill "pods" behind one name (127.0.0.1 and 127.0.0.2, same ports), each with a
    # real ZeroMQ store-event publisher; the router discovers them, subscribes to both, and
    # sends a prompt to the pod that announced its chunks. When that pod's address stops
    # resolving, the router forgets what it held and routes to the other.
    from kvrelay.bench.local_redis import free_port
    from kvrelay.common.keys import chunk_keys_from_digest
    from kvrelay.common.secrets import KeyUse, derive_key
    from kvrelay.store.publisher import Publisher, published_key

    answers = {"kv-prefill": ["127.0.0.1", "127.0.0.2"], "kv-decode": ["127.0.0.1"]}

    async def resolver(host: str, port: int) -> list[str]:
        return list(answers[host])

    async def go() -> None:
        p_port, e_port = free_port(), free_port()
        p1, p2, dn = Fake(), Fake(), Fake()
        salt = derive_key(b"k" * 32, KeyUse.EVENTS)                 # the router's secret, below
        pubs = [Publisher(host, e_port, salt) for host in ("127.0.0.1", "127.0.0.2")]
        fp = b"f" * 32
        for pub in pubs:
            pub.bind_engine(fp, 256)
        async with fake_node(p1, "127.0.0.1", p_port), fake_node(p2, "127.0.0.2", p_port), fake_node(dn):
            d_port = int(dn.url.rsplit(":", 1)[1])
            cfg = kcfg.from_dict({"router": {
                "policy": "cache_aware", "tokenizer": str(tiny_model), "first_token": "decode",
                "prefill": [f"dns+http://kv-prefill:{p_port}=tcp://kv-prefill:{e_port}"],
                "decode": [f"dns+http://kv-decode:{d_port}=tcp://kv-decode:9100"],
                "health_interval_s": 0.1, "dns_refresh_s": 0.1, "expose_nodes": True}})
            router = Router(cfg, secret=b"k" * 32, resolver=resolver)
            prompt = "".join(chr(97 + i % 26) for i in range(600))
            assert router.tokenizer is not None and router.index is not None
            keys = chunk_keys_from_digest(router.tokenizer({"prompt": prompt})[:512], fp, 256)
            async with serve(router.app()) as url, aiohttp.ClientSession() as s:
                await _until(lambda: sum(n.healthy for n in router.prefill.nodes) == 2)
                await _until(lambda: router.index.events > 0, lambda: pubs[1]("stored", keys))
                assert await _prefill_of(s, url, prompt) == p2.url
                # what went over the wire names no chunk key: only their salted names
                assert keys[0] not in router.index.holders and published_key(salt, keys[0]) in router.index.holders
                answers["kv-prefill"] = ["127.0.0.1"]                  # pod 2 is gone
                await _until(lambda: [n.url for n in router.prefill.nodes] == [p1.url])
                assert all(p2.url not in held for held in router.index.holders.values())
                assert await _prefill_of(s, url, prompt) == p1.url
        for pub in pubs:
            pub.close()
    run(go())


async def _until(cond, action=None, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        if action is not None:
            action()
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def _prefill_of(s: aiohttp.ClientSession, url: str, prompt: str) -> str:
    async with s.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "stream": True}) as r:
        assert r.status == 200 and b"[DONE]" in await r.read()
        return r.headers["X-Kvrelay-Prefill"]


def test_a_named_push_target_allows_every_address_of_the_name_and_nothing_else():
    answers: dict[str, Any] = {"d.svc": ["10.0.0.1", "10.0.0.2"]}
    calls = []

    def resolve(name: str) -> list[str]:
        calls.append(name)
        answer = answers.get(name, [])
        if isinstance(answer, Exception):
            raise answer
        return answer

    allow = PushAllowlist(["tcp://d.svc:9100", "tcp://10.9.9.9:9100"], resolve=resolve)
    assert calls == ["d.svc"]                                     # resolved once when made
    assert "tcp://10.9.9.9:9100" in allow
    assert "tcp://10.0.0.2:9100" in allow
    assert "tcp://10.0.0.2:9200" not in allow                     # right address, wrong port
    assert "tcp://10.0.0.7:9100" not in allow
    assert calls == ["d.svc"]                                     # membership never resolves
    answers["d.svc"] = ["10.0.0.7"]
    allow.refresh()                                               # what the background thread does
    assert "tcp://10.0.0.7:9100" in allow and "tcp://10.0.0.1:9100" not in allow
    answers["d.svc"] = OSError("Temporary failure in name resolution")
    allow.refresh()                                               # a failed refresh keeps the last answer
    assert "tcp://10.0.0.7:9100" in allow
    answers["d.svc"] = []
    allow.refresh()                                               # so does an empty one
    assert "tcp://10.0.0.7:9100" in allow


def test_the_allowlist_is_never_resolved_on_the_request_path():
    """Before the fix a membership test called getaddrinfo inline (every 5 s per name, and a failed
    lookup refused every push for 5 s): a resolver that hangs must not hold a check up."""
    import threading
    import time

    hang = threading.Event()
    first = [True]

    def resolve(name: str) -> list[str]:
        if first[0]:
            first[0] = False
            return ["10.0.0.1"]
        hang.wait(30)                                             # DNS that does not answer
        return ["10.0.0.1"]

    allow = PushAllowlist(["tcp://d.svc:9100"], ttl_s=0.01, resolve=resolve).start()
    time.sleep(0.1)                                               # the refresher is stuck in DNS now
    t0 = time.monotonic()
    for _ in range(100):
        assert "tcp://10.0.0.1:9100" in allow
    assert time.monotonic() - t0 < 1.0
    hang.set()
    allow.close()


def test_the_system_resolver_answers_for_localhost():
    real = PushAllowlist(["tcp://localhost:9100"])                # the system resolver
    assert "tcp://127.0.0.1:9100" in real and "tcp://127.0.0.2:9100" not in real
