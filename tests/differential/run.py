"""Send generated requests to one plain vLLM and to kvrelay, and collect the differences.

Servers: :func:`reference_answers` starts plain vLLM servers with the dtype and the OpenMP
binding of each engine of a 1P1D stack (CPU numerics change with the thread count), one per
core, asks them every request and stops them. kvrelay is asked through both of a stack's
routers - the stack's own and :func:`extra_router` with the other ``router.first_token`` -
with several requests in flight at once, as clients send them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvrelay.core import config as kcfg
from kvrelay.deploy import launch
from tests.differential.compare import Answer, differences
from tests.differential.surface import Request
from tests.e2e.routers import spawn_router

TIMEOUT_S = 600


@dataclass(frozen=True)
class Difference:
    request: Request
    target: str                  # e.g. "tcp/prefill"
    lines: list[str]

    def __str__(self) -> str:
        return f"[{self.target}] {self.request.describe()}\n    " + "\n    ".join(self.lines)


async def _send(session: aiohttp.ClientSession, url: str, req: Request) -> Answer:
    headers = {"Content-Type": "application/json", **req.headers}
    try:
        async with session.post(f"{url}{req.path}", data=msgspec.json.encode(req.body), headers=headers) as r:
            return Answer(r.status, r.headers.get("Content-Type", ""), await r.read())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Answer(-1, "", f"{type(exc).__name__}: {exc}".encode())


async def _send_all(url: str, reqs: list[Request], concurrency: int, progress: Any = None) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(req: Request) -> Answer:
            async with gate:
                answer = await _send(session, url, req)
            if progress is not None:
                progress.update(1)
            return answer
        return list(await asyncio.gather(*(one(r) for r in reqs)))


def ask(url: str, reqs: list[Request], concurrency: int = 1, desc: str = "") -> list[Answer]:
    """Every request's answer from ``url``, ``concurrency`` in flight (a progress bar on a terminal)."""
    from tqdm import tqdm

    with tqdm(total=len(reqs), desc=desc or url, unit="req", disable=not sys.stderr.isatty()) as bar:
        return asyncio.run(_send_all(url, reqs, concurrency, bar))


def compare(reqs: list[Request], want: list[Answer], have: list[Answer], target: str) -> list[Difference]:
    out = []
    for req, ref, got in zip(reqs, want, have, strict=True):
        lines = differences(ref, got)
        if lines:
            out.append(Difference(req, target, lines))
    return out


def reference_answers(cfg: kcfg.KVRelayConfig, reqs: list[Request], port: int, log_dir: Path,
                      concurrency: int = 1) -> list[Answer]:
    """Start plain vLLM servers (one per core, each bound as one engine of a 1P1D stack:
    :mod:`kvrelay.bench.reference`), ask them every request, stop them. ``concurrency`` > 1 asks
    unseeded requests that many at a time on each server; seeded ones always go one at a time
    per server, after them: vLLM 0.32's CPU build kills its engine when a seeded prompt is
    prefilled over several steps, which sharing a step's token budget with other requests
    causes (surface.SEEDED_MAX_PROMPT)."""
    from kvrelay.bench.reference import servers

    with servers(cfg, port, log_dir, startup_s=cfg.deploy.startup_timeout_s) as running:
        return answers_from(running.urls, reqs, concurrency)


def answers_from(urls: list[str], reqs: list[Request], concurrency: int = 1) -> list[Answer]:
    """Every request's answer from the plain vLLM servers at ``urls``, as :func:`reference_answers` asks them."""
    seeded = [i for i, r in enumerate(reqs) if "seed" in r.body]
    rest = [i for i, r in enumerate(reqs) if "seed" not in r.body]
    answers = _ask_each(urls, [reqs[i] for i in rest], max(1, concurrency), "one vLLM")
    answers += _ask_each(urls, [reqs[i] for i in seeded], 1, "one vLLM (seeded)")
    by_index = dict(zip(rest + seeded, answers, strict=True))
    return [by_index[i] for i in range(len(reqs))]


def _ask_each(urls: list[str], reqs: list[Request], concurrency: int, desc: str) -> list[Answer]:
    """``reqs`` dealt over ``urls`` in turn, ``concurrency`` in flight on each, all at once; the
    answers in the requests' order."""
    from concurrent.futures import ThreadPoolExecutor

    shares = [reqs[k::len(urls)] for k in range(len(urls))]
    with ThreadPoolExecutor(len(urls)) as pool:
        got = list(pool.map(lambda k: ask(urls[k], shares[k], concurrency, desc), range(len(urls))))
    out: list[Answer] = [Answer(-1, "", b"")] * len(reqs)
    for k, answers in enumerate(got):
        out[k::len(urls)] = answers
    return out


EXTRA_DISAGG_MIN = 256    # the extra router (decode_first): prompts this short are served by D alone


def extra_router(stack: launch.Stack, port: int, first_token: str) -> tuple[subprocess.Popen, str]:
    """A second router over the same nodes with another ``router.first_token``; (process, URL).
    Under ``router.decode_first`` it serves prompts of up to :data:`EXTRA_DISAGG_MIN` tokens on
    D alone (it follows no KV events: :func:`tests.e2e.routers.spawn_router`), so the comparison
    covers the decode-only path as well as the transfers."""
    over: dict[str, Any] = {"first_token": first_token}
    if stack.cfg.router.decode_first:
        over.update(disagg_min_tokens=EXTRA_DISAGG_MIN, disagg_min_tokens_idle=EXTRA_DISAGG_MIN)
    return spawn_router(stack, first_token, port, **over)


def other_mode(first_token: str) -> str:
    return "decode" if first_token == "prefill" else "prefill"


def routers_of(stack: launch.Stack, port: int, both: bool = True) -> tuple[dict[str, str], subprocess.Popen | None]:
    """``{first_token: router URL}`` for both modes over ``stack`` (``both``; else the stack's own
    router alone), and the extra router's process."""
    own = stack.cfg.router.first_token.value
    routers = {own: f"http://127.0.0.1:{stack.cfg.router.port}"}
    if not both:
        return routers, None
    proc, url = extra_router(stack, port, other_mode(own))
    return {**routers, other_mode(own): url}, proc


def busy_prefill_args(blocks: int = 33, budget: int = 512) -> list[str]:
    """A prefill node with a small KV cache (33 blocks of 128 tokens: vLLM refuses fewer for a
    4,096-token context) and a small token budget per step."""
    return ["--num-gpu-blocks-override", str(blocks), "--max-num-batched-tokens", str(budget),
            "--max-num-seqs", "24"]


class Decoders:
    """Requests in their decode phase on the prefill node itself, sent to it directly: they grow
    by a block every 128 tokens while the router's prefills run beside them, which is what makes
    vLLM's scheduler run out of blocks and preempt on this host (``shared/FACTS.md``: prefill-only
    traffic gave 0 preemptions). Stops by itself after ``limit_s``."""

    def __init__(self, url: str, streams: int = 6, prompt: int = 600, tokens: int = 1200, limit_s: float = 900) -> None:
        import threading

        self.url, self.streams, self.prompt, self.tokens, self.limit_s = url, streams, prompt, tokens, limit_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def _loop(self, i: int) -> None:
        import json
        import time
        import urllib.request

        deadline = time.monotonic() + self.limit_s
        k = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            k += 1
            body = {"model": "kvrelay-tiny", "prompt": f"{i}-{k} " + "x" * self.prompt, "max_tokens": self.tokens,
                    "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
            except OSError:
                time.sleep(0.5)

    def __enter__(self) -> Decoders:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def preemptions(node_url: str) -> float:
    """vLLM's own count of preemptions on a node (``vllm:num_preemptions_total``)."""
    import urllib.request

    with urllib.request.urlopen(f"{node_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


def with_router(cfg: kcfg.KVRelayConfig, **router: Any) -> kcfg.KVRelayConfig:
    return msgspec.structs.replace(cfg, router=msgspec.structs.replace(cfg.router, **router))
