"""A vLLM general plugin: the busy-wait window of vLLM's shared-memory message queue.

Why: vLLM always runs the model in a worker process on CPU hosts (its CPU platform turns
``--distributed-executor-backend uni`` into ``mp``). The engine core and the worker talk
through a shared-memory ``MessageQueue`` whose readers, after every message, busy-wait with
``sched_yield`` for ``SpinCondition.busy_loop_s`` - one second, hard-coded in vLLM 0.32 -
before they park on a ZeroMQ socket. A server that answers a request more often than once a
second therefore keeps two processes spinning for as long as it serves: measured here, a
1P1D stack at one request every 160 ms kept each worker's main thread at 70-82 % of its core
with about 20 ms of model work per request. On a host where the prefill node, the decode
node, the router and the clients share a few cores, those spinners take the CPU that the API
servers, the router and the push and install threads need (upstream: vllm#19036, and the
open proposals vllm#51950 / #52814 to make the window configurable).

Contract:

* vLLM calls :func:`register` in each of its processes (API server, engine core, worker)
  through the ``vllm.general_plugins`` entry point. It does nothing unless
  :data:`BUSY_LOOP_ENV` is set - the launcher sets it from ``engine.mq_busy_loop_s`` - so
  vLLM servers started by anything else in the same environment are untouched.
* With it set, every ``SpinCondition`` created afterwards in that process gets that window
  (seconds; ``0`` parks at once). Writers are unaffected (vLLM sets theirs to 0).
* If this vLLM has no ``SpinCondition(busy_loop_s=...)``, or no recheck interval to shorten
  (below), the plugin logs a warning and leaves
  vLLM as it is (a newer vLLM may have its own knob); a malformed value is a ``ValueError``
  that stops the server at start, with the variable's name in the message.
* With it set, a parked reader also re-reads the queue's written-flag every
  :data:`RECHECK_MS` instead of vLLM's 5 s (``SHM_READER_RECHECK_INTERVAL_MS``). vLLM's
  write notifications can be lost (a PUB socket with a send high-water mark of 1 drops a
  ping while the previous one is still accounted in flight) and that recheck is its only
  recovery. With a 1 s window readers almost never park while serving, so the race is rare;
  with a short one they park between steps, and a lost ping froze a decode node for ~5 s
  every half minute or so under load (``kvrelay bench serve``: every PD system's 3-5 s
  stall windows - the engine core waiting on the worker's answer, the worker parked on a
  request already in the queue). A 10 ms recheck bounds that to 10 ms and costs a parked
  reader ~100 flag reads a second.
* Idempotent: vLLM may load plugins more than once per process.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

BUSY_LOOP_ENV = "KVRELAY_MQ_BUSY_LOOP_S"
RECHECK_MS = 10          # a parked reader's written-flag recheck (vLLM's own: 5000 ms)

log = logging.getLogger("vllm.kvrelay.plugin")


def busy_loop_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The requested window in seconds, or None when unset (vLLM's own default applies)."""
    raw = environ.get(BUSY_LOOP_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{BUSY_LOOP_ENV}={raw!r}: expected seconds, e.g. 0.002") from exc
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{BUSY_LOOP_ENV}={raw!r}: expected a finite number of seconds >= 0")
    return value


def apply(cls: Any, seconds: float) -> bool:
    """Give ``cls`` (vLLM's ``SpinCondition``) ``seconds`` as its default window; False if it has none."""
    if getattr(cls, "_kvrelay_busy_loop_s", None) is not None:
        cls._kvrelay_busy_loop_s = seconds
        return True
    if "busy_loop_s" not in inspect.signature(cls.__init__).parameters:
        return False
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("busy_loop_s", cls._kvrelay_busy_loop_s)
        original(self, *args, **kwargs)

    cls._kvrelay_busy_loop_s = seconds
    cls.__init__ = __init__
    return True


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (see the module docstring)."""
    seconds = busy_loop_s()
    if seconds is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not isinstance(getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None), int):
        # no recheck to shorten: parking often would risk long lost-ping stalls
        log.warning("kvrelay: this vLLM has no SHM_READER_RECHECK_INTERVAL_MS; %s is ignored", BUSY_LOOP_ENV)
        return
    if not apply(shm_broadcast.SpinCondition, seconds):
        log.warning("kvrelay: this vLLM's SpinCondition has no busy_loop_s; %s is ignored", BUSY_LOOP_ENV)
        return
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
    log.debug("kvrelay: message-queue readers busy-wait %.4f s, then park with a %d ms recheck",
              seconds, RECHECK_MS)
