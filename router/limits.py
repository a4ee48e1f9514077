"""Who may use the router, and how much: API keys, per-key rate limits, admission control.

* :class:`ApiKeys` - bearer tokens as vLLM's ``--api-key`` takes them (``router.api_keys``,
  ``router.api_keys_file`` and the env var ``KVRELAY_API_KEY``), compared in constant time.
  No key configured = an open router (vLLM's default).
* :class:`TokenBucket` / :class:`RateLimits` - one bucket per API key (or client address).
* :class:`ClientSlots` - at most ``router.max_inflight_per_client`` open requests per API key
  (or client address), so one client's slow or stuck streams cannot take every slot.
* :class:`Admission` - at most ``capacity`` requests in flight; up to ``max_queued`` more
  wait (FIFO) for at most ``timeout_s``; anything beyond is refused at once. The caller
  answers a refusal with 429 and ``Retry-After``. A new capacity (decode nodes joined or left,
  :meth:`Admission.resize`) takes effect at once: waiters are admitted into the room it makes.

Clocks are injected; nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path

from kvrelay.common.errors import ConfigError, KVRelayError
from kvrelay.common.secrets import API_KEY_ENV
from kvrelay.core.config import RouterConfig

MAX_BUCKETS = 100_000          # distinct clients tracked; the least recently seen is forgotten


class Overloaded(KVRelayError):
    """Admission refused: ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def from_config(cls, rc: RouterConfig, environ: dict[str, str] | None = None) -> ApiKeys:
        env = os.environ if environ is None else environ
        keys = list(rc.api_keys) + ([env[API_KEY_ENV]] if env.get(API_KEY_ENV) else [])
        if rc.api_keys_file:
            try:
                keys += [line.strip() for line in Path(rc.api_keys_file).read_text().splitlines() if line.strip()]
            except OSError as exc:
                raise ConfigError(f"router.api_keys_file {rc.api_keys_file}: {exc.strerror or exc}") from exc
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """The key an ``Authorization: Bearer KEY`` header presents if valid, else None. Every
        configured key is compared (constant time), so timing says nothing about which matched."""
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for key in self._keys:
            if hmac.compare_digest(key, presented):
                found = key.decode()
        return found


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, now

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class RateLimits:
    def __init__(self, rate: float, burst: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst or max(1, int(2 * rate)))
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, who: str) -> float:
        """0 if ``who`` may send a request now, else the seconds to wait (rate limiting off: 0)."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        bucket = self._buckets.pop(who, None) or TokenBucket(self.rate, self.burst, now)
        self._buckets[who] = bucket                 # most recently seen last
        while len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return bucket.take(now)


class ClientSlots:
    """Open requests per client, at most ``limit`` each (0 = no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def take(self, who: str) -> bool:
        """Open one request for ``who``; False (nothing taken) if it already has ``limit`` open."""
        n = self._open.get(who, 0)
        if self.limit and n >= self.limit:
            return False
        self._open[who] = n + 1
        return True

    def give(self, who: str) -> None:
        n = self._open.pop(who, 0) - 1
        if n > 0:
            self._open[who] = n


class Admission:
    """Bounded concurrency with a bounded FIFO wait (one event loop; not thread-safe)."""

    def __init__(self, capacity: int, max_queued: int, timeout_s: float) -> None:
        self.capacity, self.max_queued, self.timeout_s = capacity, max_queued, timeout_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Admit the caller, waiting in line if full; Overloaded if the line is full or too slow."""
        if self.inflight < self.capacity and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(f"the router is at capacity ({self.inflight} requests in flight, "
                             f"{len(self._waiters)} waiting)", 1.0)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except BaseException as exc:                     # timed out, or the client went away
            if fut.done() and not fut.cancelled():       # admitted just as the wait ended: give it back
                self.release()
            else:
                fut.cancel()
            if isinstance(exc, TimeoutError):
                raise Overloaded(f"no capacity within {self.timeout_s:.3g}s ({self.inflight} in flight)",
                                 1.0) from None
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self) -> None:
        """One admitted request ended: its slot passes to the first waiter, if any (and if the
        capacity, perhaps lowered meanwhile, has room)."""
        self.inflight -= 1
        self._admit_waiting()

    def resize(self, capacity: int) -> None:
        """A new capacity, at once: raised, it admits waiters into the room it makes; lowered,
        requests in flight finish and nobody new is admitted until there is room."""
        self.capacity = capacity
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self._waiters and self.inflight < self.capacity:
            fut = self._waiters.popleft()
            if not fut.done():                           # (a waiter that gave up is skipped)
                self.inflight += 1
                fut.set_result(None)
