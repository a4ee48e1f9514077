"""The router's front door, against scripted upstreams over real HTTP (real sockets, real
aiohttp servers): API keys, body limit, admission control, rate limits, TLS, and the
signatures on the kv_transfer_params it sends the engines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvrelay.core import config as kcfg
from kvrelay.core.params import ParamsError, ParamsRefusal, ParamsVerifier, PullParams, PushParams
from kvrelay.router.app import Router, tls_context
from kvrelay.router.limits import ApiKeys
from kvrelay.router.pools import Node, Pool
from tests.router.test_router import Fake, fake_node, one_pair, run

SECRET = os.environ["KVRELAY_SECRET"].encode()
BODY = {"model": "m", "prompt": "hello", "max_tokens": 2, "stream": True}


def test_api_keys_401_with_an_openai_error_body():
    async def go():
        async with one_pair(api_keys=["key-one", "key-two"]) as (url, s, pn, dn):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
                async with s.post(f"{url}/v1/completions", json=BODY, headers=headers) as r:
                    assert r.status == 401
                    err = (await r.json())["error"]
                    assert err["code"] == "invalid_api_key" and "API key" in err["message"]
            assert not pn.requests and not dn.requests          # no engine saw an unauthenticated request
            async with s.post(f"{url}/v1/completions", json=BODY, headers={"Authorization": "Bearer key-two"}) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            async with s.get(f"{url}/health") as r:               # probes stay open, as in vLLM
                assert r.status == 200
            async with s.get(f"{url}/v1/models") as r:
                assert r.status == 401
            async with s.get(f"{url}/metrics") as r:
                assert 'kvrelay_router_client_errors_total{cause="unauthorized",model_name="kvrelay-tiny"} 4.0' in await r.text()
    run(go())
    keys = ApiKeys.from_config(kcfg.from_dict({}).router, {"KVRELAY_API_KEY": "from-env"})
    assert keys.enabled and keys.check("Bearer from-env") == "from-env" and keys.check("Bearer x") is None


def test_oversize_body_gets_a_json_413_and_reaches_no_engine():
    async def go():
        async with one_pair(max_body_bytes="64KiB") as (url, s, pn, dn):
            big = {**BODY, "prompt": "x" * (100 << 10)}
            async with s.post(f"{url}/v1/completions", json=big) as r:       # Content-Length says so
                assert r.status == 413
                assert "router.max_body_bytes" in (await r.json())["error"]["message"]

            async def chunks():
                yield b'{"model": "m", "prompt": "'
                for _ in range(100):
                    yield b"x" * 1024
                yield b'"}'
            async with s.post(f"{url}/v1/completions", data=chunks(),             # chunked: no length
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413 and r.content_type == "application/json"
            assert not pn.requests and not dn.requests
            async with s.get(f"{url}/metrics") as r:
                assert 'kvrelay_router_client_errors_total{cause="body_too_large",model_name="kvrelay-tiny"} 2.0' in await r.text()
    run(go())


def test_a_flood_past_admission_gets_429s_while_the_admitted_requests_complete():
    async def go():
        async with one_pair(d_mode="trickle", max_inflight=2, max_queued=3, queue_timeout_s=20) as \
                (url, s, pn, dn):
            async def one() -> tuple[int, bytes, str]:
                async with s.post(f"{url}/v1/completions", json=BODY) as r:
                    return r.status, await r.read(), r.headers.get("Retry-After", "")

            results = await asyncio.gather(*(one() for _ in range(12)))
            ok = [b for st, b, _ in results if st == 200]
            limited = [ra for st, _, ra in results if st == 429]
            assert len(ok) == 5 and len(limited) == 7, [st for st, _, _ in results]   # 2 running + 3 queued
            assert all(b.endswith(b"data: [DONE]\n\n") for b in ok)
            assert all(ra.isdigit() and int(ra) >= 1 for ra in limited)
            assert len(dn.requests) == 5                              # the refused ones reached no engine
            async with s.post(f"{url}/v1/completions", json=BODY) as r:   # capacity is back
                assert r.status == 200
            async with s.get(f"{url}/metrics") as r:
                assert 'kvrelay_router_request_failures_total{cause="overloaded",model_name="kvrelay-tiny"} 7.0' in await r.text()
    run(go())


def test_one_client_holds_at_most_its_share_of_open_requests():
    """``router.max_inflight_per_client``: a client (by address here, no keys) with 2 streams open
    gets a 429 for a third, and its slot comes back when one ends."""
    async def go():
        async with one_pair(d_mode="trickle", max_inflight_per_client=2) as (url, s, pn, dn):
            async def one() -> int:
                async with s.post(f"{url}/v1/completions", json=BODY) as r:
                    await r.read()
                    return r.status
            first = [asyncio.create_task(one()) for _ in range(2)]
            await asyncio.sleep(0.3)                                   # both open (trickling)
            assert await one() == 429
            assert await asyncio.gather(*first) == [200, 200]
            assert await one() == 200
            async with s.get(f"{url}/metrics") as r:
                assert 'kvrelay_router_client_errors_total{cause="client_inflight_limit",model_name="kvrelay-tiny"} 1.0' in await r.text()
    run(go())


def test_slow_body_clients_hold_no_admission_slot_and_get_a_json_408():
    """Bodies are read before admission, under router.body_timeout_s: clients that trickle
    their bodies never fill admission, and each ends with a 408 JSON error."""
    async def slow_body(url: str) -> bytes:
        """Trickle a body, reading while sending (as HTTP clients that take an early answer do):
        once the router's answer is in, stop and close the sending side, so the router's
        lingering read of the rest of the body ends at once instead of after aiohttp's 10 s."""
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        await writer.drain()
        head = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
        with contextlib.suppress(ConnectionError):  # the router answered and closed
            for _ in range(40):                    # 1 byte every 0.1 s: never the whole body in time
                if head.done():
                    break
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.1)
            writer.write_eof()
        answer = await head + await reader.read()
        writer.close()
        return answer

    async def go():
        async with one_pair(max_inflight=1, max_queued=0, body_timeout_s=1.0) as (url, s, pn, dn):
            slow = [asyncio.create_task(slow_body(url)) for _ in range(6)]
            await asyncio.sleep(0.3)               # the slow clients are connected and trickling
            for _ in range(3):                     # admission (1 slot, no queue) is free for honest ones
                async with s.post(f"{url}/v1/completions", json=BODY) as r:
                    assert r.status == 200 and "X-Kvrelay-Prefill" not in r.headers
            answers = await asyncio.gather(*slow)
            for a in answers:
                assert a.startswith(b"HTTP/1.1 408") and b"router.body_timeout_s" in a, a[:200]
            assert len(dn.requests) == 3                          # no slow body reached an engine
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
                assert 'kvrelay_router_client_errors_total{cause="body_timeout",model_name="kvrelay-tiny"} 6.0' in text
                assert 'cause="overloaded"' not in text
    run(go())


def test_rate_limit_per_key():
    async def go():
        async with one_pair(api_keys=["a", "b"], rate_limit_rps=0.5, rate_limit_burst=2) as (url, s, pn, dn):
            statuses = []
            for _ in range(3):
                async with s.post(f"{url}/v1/completions", json=BODY, headers={"Authorization": "Bearer a"}) as r:
                    statuses.append(r.status)
                    retry = r.headers.get("Retry-After")
            assert statuses == [200, 200, 429] and retry is not None and int(retry) >= 1
            async with s.post(f"{url}/v1/completions", json=BODY, headers={"Authorization": "Bearer b"}) as r:
                assert r.status == 200                               # another key has its own bucket
    run(go())


def test_engine_params_are_signed_and_a_changed_field_breaks_the_signature():
    async def go():
        async with one_pair() as (url, s, pn, dn):
            async with s.post(f"{url}/v1/completions", json={**BODY, "stream": False}) as r:
                assert r.status == 200
            return pn.requests[0]["kv_transfer_params"], dn.requests[0]["kv_transfer_params"]
    push, pull = run(go())
    on_p = ParamsVerifier(SECRET, PushParams, allowed_push=["tcp://127.0.0.1:9100"])
    on_d = ParamsVerifier(SECRET, PullParams)
    assert isinstance(on_p.check(push), PushParams) and isinstance(on_d.check(pull), PullParams)
    cases = [(on_p, {"kvrelay": {**push["kvrelay"], "push_to": "tcp://attacker:1"}}, ParamsRefusal.BAD_SIGNATURE),
             (on_p, {"kvrelay": {**push["kvrelay"], "sig": ""}}, ParamsRefusal.UNSIGNED),
             (on_d, {"kvrelay": {**pull["kvrelay"], "transfer_id": "someone-else"}}, ParamsRefusal.BAD_SIGNATURE),
             (on_d, push, ParamsRefusal.WRONG_ROLE),
             (ParamsVerifier(SECRET, PushParams, allowed_push=["tcp://10.0.0.9:9100"]), push,
              ParamsRefusal.NOT_ALLOWED),
             (ParamsVerifier(SECRET, PullParams, clock=lambda: 4e9), pull, ParamsRefusal.EXPIRED),
             (ParamsVerifier(b"another-deployment-secret", PullParams), pull, ParamsRefusal.BAD_SIGNATURE)]
    for verifier, params, cause in cases:
        with pytest.raises(ParamsError) as err:
            verifier.check(params)
        assert err.value.cause is cause


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_router_serves_https_with_its_certificate(tmp_path: Path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    cfg = kcfg.from_dict({"router": {"tls_cert": str(cert), "tls_key": str(key), "health_interval_s": 0.2}})

    async def go():
        pn, dn = Fake(), Fake()
        async with fake_node(pn), fake_node(dn):
            router = Router(cfg, Pool("prefill", [Node(pn.url)], cfg.router.policy),
                            Pool("decode", [Node(dn.url, "tcp://127.0.0.1:9100")], cfg.router.policy))
            runner = web.AppRunner(router.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls_context(cfg))
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            try:
                await asyncio.sleep(0.5)
                client_ctx = ssl.create_default_context(cafile=str(cert))
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"https://127.0.0.1:{port}/v1/completions", json=BODY, ssl=client_ctx) as r:
                        assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                    with pytest.raises(aiohttp.ClientError):       # plain HTTP is not served
                        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY) as r:
                            await r.read()
            finally:
                await runner.cleanup()
    run(go())
    with pytest.raises(kcfg.ConfigError):
        tls_context(kcfg.from_dict({"router": {"tls_cert": str(cert)}}))
