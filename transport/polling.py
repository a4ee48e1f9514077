"""Adaptive polling: spin with ``sched_yield`` briefly, then back off to sleeps.

NIXL and UCX completions must be polled from our own thread (their progress
threads busy-poll a core and starve the model). Polling forever with
``sched_yield`` would do the same, so :class:`Backoff` yields for the first
``spin`` polls (microsecond latency for a transfer that is about to finish)
and then sleeps with exponentially growing intervals up to ``max_sleep``.
"""

from __future__ import annotations

import os
import time


class Backoff:
    def __init__(self, timeout: float | None = None, *, spin: int = 200, min_sleep: float = 20e-6,
                 max_sleep: float = 1e-3) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.spin, self.min_sleep, self.max_sleep = spin, min_sleep, max_sleep
        self.polls = 0

    def reset(self) -> None:
        self.polls = 0

    def wait(self) -> bool:
        """Pause before the next poll. False once the deadline has passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return False
        self.polls += 1
        if self.polls <= self.spin:
            os.sched_yield()
        else:
            exp = min(self.polls - self.spin, 16)
            time.sleep(min(self.min_sleep * (1 << exp), self.max_sleep))
        return True
