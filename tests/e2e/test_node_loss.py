"""Losing a node under load, on real vLLM engines, answers compared with one plain vLLM with the
same dtype and thread binding (one pinned thread per engine).

One 2P2D stack per transport (tcp; nixl too with ``--matrix``: what is tested is the router's
migration, which no transport changes), ``router.first_token: prefill`` (token 1 from P):

* 1P2D (one prefill node killed first): 16 concurrent greedy streams with 240-token
  answers; once every stream has tokens, SIGKILL the process group of the decode node with
  the most of them running. Every stream completes - no error event, no duplicate or
  missing token - and equals the uninterrupted answer; the router counts the migrations.
* 2P1D (that prefill node restarted): the same load; SIGKILL a prefill node while it
  computes token 1s: every answer completes and is exact. Then SIGKILL the other one: with
  no prefill node left, the decode node serves requests alone, still exact.
* 0P2D (the killed decode node restarted): the decode nodes answer alone (the path
  decode-first's ``decode_only`` answers take); SIGKILL the busier mid-stream: every stream
  goes on on the other node, exact.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from kvrelay.deploy import launch
from tests.e2e.harness import MODEL, Case, PlainServers, busiest_decode, retire, scrape, start_stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]   # stacks of 4 engines start in minutes on 2 cores
N, ANSWER = 16, 240
LOSS = [Case(f"loss{i}", "completion", True, 300 + 37 * i, 4000 + i) for i in range(N)]


def _body(case: Case, stream: bool) -> dict:
    return {"model": MODEL, "prompt": case.text(), "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
            "stream": stream}


@pytest.fixture(scope="module")
def want(plain: PlainServers) -> dict[str, str]:
    """The uninterrupted answers: plain vLLM, bound like each engine of the stack (one core per
    server, a server per core: :class:`~tests.e2e.harness.PlainServers`)."""
    from kvrelay.bench.reference import spread

    def answer(url: str, case: Case) -> str:
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(_body(case, False)).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return str(json.loads(r.read())["choices"][0]["text"])

    with plain.use(4) as urls:
        return dict(zip([c.name for c in LOSS], spread(urls, LOSS, answer), strict=True))


@pytest.fixture(scope="module", params=["tcp", pytest.param("nixl", marks=pytest.mark.matrix)])
def loss_stack(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    port0 = {"tcp": 22300, "nixl": 22600}[request.param]
    handle = start_stack(tiny_model, tmp_path_factory.mktemp(f"loss-{request.param}"), port0,
                         transport__backend=request.param, deploy__prefill=2, deploy__decode=2,
                         router__first_token="prefill", router__health_interval_s=0.5, connector__first_chunk_s=10)
    yield handle
    retire(handle.stack)


class Stream:
    """One client stream: the text it got, how it ended."""

    def __init__(self, case: Case) -> None:
        self.case, self.text, self.errors, self.done, self.status = case, "", list[str](), False, 0

    async def run(self, session: aiohttp.ClientSession, url: str) -> None:
        async with session.post(f"{url}/v1/completions", json=_body(self.case, True)) as r:
            self.status = r.status
            pending = b""
            async for piece in r.content.iter_any():
                *events, pending = (pending + piece).split(b"\n\n")
                for raw in events:
                    data = raw.strip().removeprefix(b"data: ")
                    if data == b"[DONE]":
                        self.done = True
                    elif data:
                        ev = json.loads(data)
                        if "error" in ev:
                            self.errors.append(ev["error"]["message"])
                        self.text += "".join(c["text"] for c in ev.get("choices", ()))


async def _load(url: str, cases: list[Case], kill_when, kill) -> list[Stream]:
    """Run ``cases`` as concurrent streams; call ``kill()`` (in a thread) once ``kill_when(streams)``."""
    streams = [Stream(c) for c in cases]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(s.run(session, url)) for s in streams]
        while not kill_when(streams):
            assert not all(t.done() for t in tasks), "every stream ended before the kill"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
    return streams


def _check(streams: list[Stream], want: dict[str, str], context: str = "") -> None:
    bad = [(s.case.name, s.status, s.errors, len(s.text)) for s in streams
           if s.status != 200 or s.errors or not s.done]
    assert not bad, f"streams that did not complete: {bad} {context}"
    wrong = [s.case.name for s in streams if s.text != want[s.case.name]]
    assert not wrong, f"answers that differ from one vLLM's: {wrong}"



def _until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)


def _healthy_prefill(url: str) -> int:
    """Prefill nodes in rotation, by the router's /health (counts per pool)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return int(json.loads(r.read())["prefill"]["healthy"])
    except urllib.error.HTTPError as exc:          # 503: a pool is empty
        return int(json.loads(exc.read())["prefill"]["healthy"])


def _steady(predicate, reads: int = 4, gap: float = 0.5) -> bool:
    """``predicate`` held at ``reads`` reads over ``reads - 1`` health intervals (not one lucky read)."""
    for i in range(reads):
        if not predicate():
            return False
        if i < reads - 1:
            time.sleep(gap)
    return True


def _fallbacks(url: str) -> dict[str, float]:
    """The router's fallback counters, by cause."""
    return {k: v for k, v in scrape(f"{url}/metrics").items() if k.startswith("kvrelay_router_fallbacks_total{")}


def _router_count(url: str, series: str) -> float:
    return sum(v for k, v in scrape(f"{url}/metrics").items() if k.startswith(series))


def test_a_killed_decode_node_loses_no_stream_and_no_token(loss_stack, want):
    stack, url = loss_stack.stack, loss_stack.router_url
    stack.kill("prefill1")                        # 1P2D
    _until(lambda: _steady(lambda: _healthy_prefill(url) == 1), "prefill1 out of rotation, prefill0 in")
    before, t0 = _fallbacks(url), time.monotonic()
    # the node with the most streams still running: one prefill node staggers the streams' starts,
    # so the first decode node to get work may have finished it by the time every stream has tokens
    streams = asyncio.run(_load(url, LOSS, lambda ss: all(len(s.text) >= 5 for s in ss),
                                lambda: stack.kill(busiest_decode(stack))))
    moved = _router_count(url, "kvrelay_router_migrations_total")
    fell_back = {k: v - before.get(k, 0) for k, v in _fallbacks(url).items() if v > before.get(k, 0)}
    print(f"decode loss: {N} streams in {time.monotonic() - t0:.0f} s, {moved:.0f} migrated, fallbacks {fell_back}")
    # a stream sent to D alone (no split) has no token ids to resume from: it cannot move
    _check(streams, want, f"router fallbacks during the load: {fell_back}")
    assert moved >= 1, "the kill moved no stream (every stream had ended?)"
    assert _router_count(url, f'kvrelay_router_migrated_requests_total{{model_name="{MODEL}",outcome="exact"}}') == moved


def test_a_killed_prefill_node_then_both_lose_nothing(loss_stack, want):
    stack, url = loss_stack.stack, loss_stack.router_url
    for name in [s.name for s in stack.specs if s.role is launch.Role.DECODE and s.name in stack.procs][1:]:
        stack.kill(name)                          # 2P1D
    if "prefill1" not in stack.procs:
        stack.restart("prefill1")
    _until(lambda: _healthy_prefill(url) == 2, "both prefill nodes in rotation")
    streams = asyncio.run(_load(url, LOSS, lambda ss: any(s.text for s in ss), lambda: stack.kill("prefill0")))
    _check(streams, want)
    stack.kill("prefill1")                        # no prefill node left: the decode node serves alone
    _until(lambda: not _healthy_prefill(url), "no prefill node in rotation")
    streams = asyncio.run(_load(url, LOSS[:4], lambda ss: True, lambda: None))
    _check(streams, want)
    assert _router_count(url, f'kvrelay_router_fallbacks_total{{cause="no_prefill_decode_only",model_name="{MODEL}"}}') >= 1


def _healthy_decode(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return int(json.loads(r.read())["decode"]["healthy"])
    except urllib.error.HTTPError as exc:
        return int(json.loads(exc.read())["decode"]["healthy"])


def test_a_killed_decode_node_answering_alone_loses_no_stream_and_no_token(loss_stack, want):
    """No prefill node in rotation (the answers decode-first sends to a decode node alone take the
    same path): each decode node answers the client's own request, asked for its token ids. With
    16 streams running on two decode nodes, SIGKILL the busier: each of its streams goes on on the
    other from the prompt's ids and the tokens sent, and every answer equals one vLLM's."""
    stack, url = loss_stack.stack, loss_stack.router_url
    for spec in stack.specs:
        if spec.role is launch.Role.PREFILL and spec.name in stack.procs:
            stack.kill(spec.name)                 # 0P: the decode nodes serve alone
        elif spec.role is launch.Role.DECODE and spec.name not in stack.procs:
            stack.restart(spec.name)              # 0P2D
    _until(lambda: not _healthy_prefill(url) and _healthy_decode(url) == 2, "0 prefill and 2 decode nodes in rotation")
    moved0 = _router_count(url, "kvrelay_router_migrations_total")
    alone0 = _router_count(url, 'kvrelay_router_fallbacks_total{cause="no_prefill_decode_only"')
    streams = asyncio.run(_load(url, LOSS, lambda ss: all(len(s.text) >= 5 for s in ss),
                                lambda: stack.kill(busiest_decode(stack))))
    moved = _router_count(url, "kvrelay_router_migrations_total") - moved0
    print(f"decode loss, answers from D alone: {N} streams, {moved:.0f} migrated")
    _check(streams, want)
    assert _router_count(url, 'kvrelay_router_fallbacks_total{cause="no_prefill_decode_only"') - alone0 == N
    assert moved >= 1, "the kill moved no stream (every stream had ended?)"
