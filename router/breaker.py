"""A per-node circuit breaker: consecutive request failures take a node out of rotation.

``/health`` says whether a node's server answers; it says nothing of a node that answers
``/health`` and then drops every request (a wedged engine, a dead transfer port, a node
that is killed between two health rounds). The breaker watches what requests see:

* **closed** - the node is picked as usual; :meth:`Breaker.failure` counts consecutive
  failures, :meth:`Breaker.success` resets the count;
* **open** - after ``threshold`` consecutive failures the node is out for a backoff that
  starts at ``base_s`` and doubles each time the node is opened again, up to ``max_s``;
* **half-open** - once the backoff has passed, :meth:`Breaker.allows` lets one request
  through (then at most one more per ``base_s`` while no answer came back): a success
  closes the breaker and resets the backoff, a failure opens it again for twice as long.

It is independent of the health loop: a node must be healthy *and* allowed by its breaker
to be picked. The clock is injected, so the state machine is tested without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class _Node:
    failures: int = 0              # consecutive, since the last success
    opened: int = 0                # times opened since the last success (the backoff's exponent)
    until: float = 0.0             # open until then
    probe_at: float = 0.0          # half-open: the next probe may go at this time


class Breaker:
    """Breaker state per node, keyed by the node's URL (URLs are unique across the pools)."""

    def __init__(self, threshold: int = 3, base_s: float = 2.0, max_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_open: Callable[[str], None] | None = None) -> None:
        """``threshold``: consecutive failures that open the breaker (0 = never open).
        ``on_open(url)`` is called each time a node's breaker opens (a metric)."""
        self.threshold, self.base_s, self.max_s = threshold, base_s, max_s
        self._clock, self._on_open = clock, on_open
        self._nodes: dict[str, _Node] = {}

    def state(self, url: str) -> BreakerState:
        n = self._nodes.get(url)
        if n is None or n.opened == 0:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self._clock() < n.until else BreakerState.HALF_OPEN

    def allows(self, url: str) -> bool:
        """May a request go to ``url`` now? Half-open, this admits one probe per ``base_s``."""
        n = self._nodes.get(url)
        if n is None or n.opened == 0:
            return True
        now = self._clock()
        if now < n.until or now < n.probe_at:
            return False
        n.probe_at = now + self.base_s
        return True

    def success(self, url: str) -> None:
        self._nodes.pop(url, None)

    def failure(self, url: str) -> None:
        if self.threshold <= 0:
            return
        n = self._nodes.setdefault(url, _Node())
        n.failures += 1
        half_open = n.opened > 0 and self._clock() >= n.until
        if half_open or (n.opened == 0 and n.failures >= self.threshold):
            backoff = min(self.max_s, self.base_s * 2 ** n.opened)
            n.opened += 1
            n.until = n.probe_at = self._clock() + backoff
            if self._on_open is not None:
                self._on_open(url)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of nodes no longer in any pool (DNS discovery removed them)."""
        for url in [u for u in self._nodes if u not in keep]:
            del self._nodes[url]
