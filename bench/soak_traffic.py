"""The soak's clients: mixed requests against the router, each ending as one :class:`Outcome`.

Every request is drawn from a seeded generator (:class:`Mix`):

* ``greedy``: a prompt of the fixed pool with its own ``max_tokens``, streamed or not; its
  text must equal the reference vLLM's answer to the same body;
* ``sampled``: the same prompts at temperature 0.8 with a seed, streamed or not (checked to
  end well, not compared: the bar for exactness is set on greedy answers);
* ``abort``: a streamed request whose client hangs up at a random point;
* ``stall``: a streamed request with a long answer whose client reads its first event and
  then nothing for ``stall_s`` (the router must drop it, not the stack), then hangs up.

How each ended (:class:`End`): complete, told (an HTTP error or an error event before
``[DONE]``), lost (cut without being told), hung (no end within ``timeout_s``), or hung up
by its own client. The loop is closed: ``concurrency`` clients each send their next request
when the previous one ends, until the deadline.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;:!?0123456789\n"


class Kind(str, enum.Enum):
    GREEDY = "greedy"
    SAMPLED = "sampled"
    ABORT = "abort"
    STALL = "stall"


class End(str, enum.Enum):
    COMPLETE = "complete"      # a whole answer: [DONE] after no error event, or a 200 body
    TOLD = "told"              # an HTTP error status or an error event: the client was told
    LOST = "lost"              # cut without an error (a truncated stream, a reset connection)
    HUNG = "hung"              # no end within the client's timeout
    HUNG_UP = "hung_up"        # the client itself hung up (the abort and stall kinds)


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    max_tokens: int

    def body(self, model: str) -> dict:
        """The greedy body: what the reference is asked, and what greedy clients send."""
        return {"model": model, "prompt": self.text, "max_tokens": self.max_tokens, "temperature": 0}


def prompt_pool(n: int, seed: int) -> list[Prompt]:
    """``n`` prompts of 30 to 1,400 characters (up to 6 chunks of the tiny model's tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chars = rng.choice((30, 120, 300, 600, 900, 1400)) + rng.randrange(0, 25)
        out.append(Prompt(i, "".join(rng.choice(ALPHABET) for _ in range(chars)), rng.choice((8, 16, 32, 64))))
    return out


@dataclass(frozen=True)
class Draw:
    kind: Kind
    prompt: Prompt
    stream: bool
    cut_s: float = 0.0          # abort: hang up after this long


@dataclass(frozen=True)
class Mix:
    """Shares of each kind (the rest is greedy) and the stall client's shape."""

    sampled: float = 0.2
    abort: float = 0.1
    stall: float = 0.02
    stall_tokens: int = 1500
    stall_s: float = 20.0

    def draw(self, rng: random.Random, pool: list[Prompt]) -> Draw:
        x, prompt, stream = rng.random(), rng.choice(pool), rng.random() < 0.6
        if x < self.stall:
            return Draw(Kind.STALL, prompt, True)
        if x < self.stall + self.abort:
            return Draw(Kind.ABORT, prompt, True, rng.uniform(0.01, 1.5))
        if x < self.stall + self.abort + self.sampled:
            return Draw(Kind.SAMPLED, prompt, stream)
        return Draw(Kind.GREEDY, prompt, stream)


@dataclass
class Outcome:
    kind: Kind
    prompt: int
    stream: bool
    t0: float
    t1: float = 0.0
    end: End = End.LOST
    text: str = ""
    detail: str = ""

    def row(self) -> dict:
        return {"kind": self.kind.value, "prompt": self.prompt, "stream": self.stream, "t0": round(self.t0, 3),
                "t1": round(self.t1, 3), "end": self.end.value, "detail": self.detail[:200]}


@dataclass
class Load:
    """The closed loop: ``concurrency`` clients until ``deadline`` (the injected clock's time)."""

    url: str
    model: str
    pool: list[Prompt]
    mix: Mix = field(default_factory=Mix)
    concurrency: int = 8
    timeout_s: float = 180.0
    seed: int = 0
    clock: Callable[[], float] = time.monotonic
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, deadline: float) -> list[Outcome]:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)     # a hung-up client's socket really closes
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            await asyncio.gather(*(self._client(session, k, deadline) for k in range(self.concurrency)))
        return self.outcomes

    async def _client(self, session: aiohttp.ClientSession, k: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + k)
        while self.clock() < deadline:
            draw = self.mix.draw(rng, self.pool)
            out = Outcome(draw.kind, draw.prompt.index, draw.stream, self.clock())
            self.outcomes.append(out)
            try:
                await asyncio.wait_for(self._one(session, draw, out), self.timeout_s)
            except asyncio.TimeoutError:
                out.end, out.detail = End.HUNG, f"no end within {self.timeout_s:g} s"
            except (aiohttp.ClientError, ConnectionError) as exc:
                out.end, out.detail = End.LOST, f"{type(exc).__name__}: {exc}"
            out.t1 = self.clock()

    def _body(self, draw: Draw) -> dict:
        body = draw.prompt.body(self.model)
        if draw.kind is Kind.SAMPLED:
            body.update(temperature=0.8, top_p=0.95, seed=draw.prompt.index)
        if draw.kind is Kind.STALL:
            body.update(max_tokens=self.mix.stall_tokens, ignore_eos=True)
        return {**body, **({"stream": True} if draw.stream else {})}

    async def _one(self, session: aiohttp.ClientSession, draw: Draw, out: Outcome) -> None:
        async with session.post(f"{self.url}/v1/completions", json=self._body(draw)) as r:
            if r.status != 200:
                out.end, out.detail = End.TOLD, f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            if draw.kind is Kind.ABORT:
                await self._abort(r, draw, out)
            elif draw.kind is Kind.STALL:
                await r.content.readany()                          # the first event, then nothing
                await asyncio.sleep(self.mix.stall_s)
                out.end = End.HUNG_UP
            elif draw.stream:
                read_stream(await r.read(), out)
            else:
                body = await r.json()
                out.text = "".join(c.get("text", "") for c in body.get("choices", ()))
                out.end = End.COMPLETE if body.get("choices") else End.LOST

    @staticmethod
    async def _abort(r: aiohttp.ClientResponse, draw: Draw, out: Outcome) -> None:
        try:
            raw = await asyncio.wait_for(r.read(), draw.cut_s)
        except asyncio.TimeoutError:
            out.end = End.HUNG_UP                                  # leaving the block closes the connection
            return
        read_stream(raw, out)                                      # it ended before the client hung up


def read_stream(raw: bytes, out: Outcome) -> None:
    """An SSE body -> the outcome's text and how it ended."""
    events = [e.strip().removeprefix("data: ") for e in raw.decode(errors="replace").split("\n\n") if e.strip()]
    done = bool(events) and events[-1] == "[DONE]"
    for e in events[:-1] if done else events:
        try:
            ev = json.loads(e)
        except ValueError:
            out.end, out.detail = End.LOST, f"not an event: {e[:80]!r}"
            return
        if "error" in ev:
            out.end, out.detail = End.TOLD, str(ev["error"].get("message", ev["error"]))[:200]
            return
        out.text += "".join(c.get("text", "") for c in ev.get("choices", ()))
    out.end = End.COMPLETE if done else End.LOST
    if not done:
        out.detail = "the stream ended without [DONE] and without an error event"
