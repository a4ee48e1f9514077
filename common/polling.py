"""Adaptive polling: spin with ``sched_yield`` briefly, then back off to sleeps.

NIXL and UCX completions must be polled from our own thread (their progress
threads busy-poll a core and starve the model). Polling forever with
``sched_yield`` would do the same, so :class:`Backoff` yields for the first
``spin`` polls (microsecond latency for a transfer that is about to finish)
and then sleeps with exponentially growing intervals up to ``max_sleep``. The
polling thread's timer slack is reduced to 1 us, so a 20 us sleep is ~20 us
rather than the default ~70 us: low latency without spinning.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def fine_timer_slack(ns: int = 1000) -> None:
    """Shrink this thread's timer slack (Linux default 50 us) so short sleeps stay short.

    Per-thread and idempotent; a no-op where prctl is unavailable.
    """
    if getattr(_slack, "done", False):
        return
    _slack.done = True
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)


class Backoff:
    def __init__(self, timeout: float | None = None, *, spin: int = 200, min_sleep: float = 20e-6,
                 max_sleep: float = 1e-3, idle_after: float | None = None, idle_sleep: float = 1e-3) -> None:
        """``idle_after``: once this long has passed without progress (:meth:`reset`), sleep
        ``idle_sleep`` between polls - a transfer that has not started (the prefill node is
        still computing) is then watched at 1 kHz instead of tens of kHz."""
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.spin, self.min_sleep, self.max_sleep = spin, min_sleep, max_sleep
        self.idle_after, self.idle_sleep = idle_after, idle_sleep
        self.polls = 0
        self._since = time.monotonic()
        fine_timer_slack()

    def reset(self) -> None:
        self.polls = 0
        self._since = time.monotonic()

    def wait(self) -> bool:
        """Pause before the next poll. False once the deadline has passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return False
        self.polls += 1
        if self.polls <= self.spin:
            os.sched_yield()
        elif self.idle_after is not None and time.monotonic() - self._since > self.idle_after:
            time.sleep(self.idle_sleep)
        else:
            exp = min(self.polls - self.spin, 16)
            time.sleep(min(self.min_sleep * (1 << exp), self.max_sleep))
        return True


# A poll that has seen no progress for IDLE_AFTER_S drops to one poll per IDLE_SLEEP_S: a transfer
# granted before its chunks start (an early Alloc while P computes or queues) is watched at 1 kHz,
# not at tens of kHz - that cost ~23 % of a core per decode node on a 2-core host.
IDLE_AFTER_S, IDLE_SLEEP_S = 5e-3, 1e-3


def progress_loop(closed: threading.Event, wake: threading.Event, busy: Callable[[], bool],
                  step: Callable[[], bool | None], backoff: Backoff) -> None:
    """A receiver backend's progress thread; returns once ``closed`` is set.

    While not ``busy()`` (nothing posted or granted) it sleeps on ``wake``. ``wake`` is set when
    receives are posted: their data may come at once, so the backoff starts over. Otherwise it
    calls ``step()``: True when it made progress (poll again at once), False when it did not
    (back off), None when it waited by itself (someone else is driving progress).
    """
    while not closed.is_set():
        if not busy() and not wake.wait(0.05):
            continue
        if wake.is_set():
            wake.clear()
            backoff.reset()
        progressed = step()
        if progressed:
            backoff.reset()
        elif progressed is False:
            backoff.wait()


T = TypeVar("T")


def wait_queue(q: queue.SimpleQueue[T], timeout: float) -> T | None:
    """The next item, blocking up to ``timeout`` (None if none came)."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


def poll_queue(q: queue.SimpleQueue[T], progress: Callable[[], int], timeout: float) -> T | None:
    """Drive ``progress`` (a poll-driven backend) from the caller's thread until an item is queued."""
    backoff = Backoff(timeout, spin=0, max_sleep=50e-6, idle_after=IDLE_AFTER_S, idle_sleep=IDLE_SLEEP_S)
    while True:
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        if progress():
            backoff.reset()
        elif not backoff.wait():
            return None
