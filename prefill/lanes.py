"""The prefill node's lanes: one thread, and at most one ``Sender``, per decode node.

A dead, slow or full decode node (connect and Alloc may block for seconds) stalls only its
own lane. A lane whose connect failed fails its pushes at once for ``DOWN_S`` (D then
recomputes) instead of reconnecting on every request. Requests that only save to the store
run on the store lane (:data:`STORE_LANE`): no decode node, no Sender.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.common.errors import HandshakeError, KVRelayError, PeerDeadError, ProtocolError
from kvrelay.transport.backends.base import SenderBackend, SourceLayout
from kvrelay.transport.config import TimeoutConfig, TransportConfig
from kvrelay.transport.sender import Sender

log = logging.getLogger("vllm.kvrelay.prefill")
DOWN_S = 2.0          # after a failed connect, pushes to that decode node fail at once for this long
STORE_LANE = ""       # the lane of store-only saves (no decode node)


@dataclass
class Lane:
    """One decode endpoint (or :data:`STORE_LANE`): its Sender and the thread that serves it."""

    endpoint: str
    sender: Sender | None = None
    thread: threading.Thread | None = None
    down_until: float = 0.0      # a connect failed: fail pushes at once until then (D recomputes)
    down_reason: str = ""


def session_lost(exc: BaseException) -> bool:
    """The Sender is no good any more (D died, restarted, or answered an ``Error``, which is
    never about one transfer - those are ``Refused``): replace it."""
    return isinstance(exc, PeerDeadError | HandshakeError | ProtocolError)


class Lanes:
    """Every lane of one worker. ``run(lane)`` is the loop each lane's thread runs."""

    def __init__(self, transport: TransportConfig, timeouts: TimeoutConfig,
                 make_backend: Callable[[TransportConfig], SenderBackend], run: Callable[[Lane], None]) -> None:
        self.transport, self.timeouts = transport, timeouts
        self._make_backend, self._run = make_backend, run
        self._lanes: dict[str, Lane] = {}
        self.fingerprint = b""                      # set when the KV caches are registered
        self.source: SourceLayout | None = None     # the registrable KV cache, if any

    def lane_for(self, endpoint: str) -> Lane:
        """The lane of ``endpoint`` (the worker's lock held); started on first use."""
        lane = self._lanes.get(endpoint)
        if lane is None:
            lane = self._lanes[endpoint] = Lane(endpoint)
            lane.thread = threading.Thread(target=self._run, args=(lane,), daemon=True,
                                           name=f"kvrelay-push-{len(self._lanes)}")
            lane.thread.start()
        return lane

    def sender(self, lane: Lane) -> Sender:
        """The lane's Sender, connecting it first if needed (blocks only this lane)."""
        if lane.sender is None:
            if time.monotonic() < lane.down_until:
                raise PeerDeadError(f"decode node {lane.endpoint} unreachable ({lane.down_reason}); "
                                    f"retrying in {lane.down_until - time.monotonic():.1f} s")
            s = Sender(self.transport, self.timeouts, lane.endpoint, self._make_backend(self.transport),
                       self.fingerprint)
            try:
                s.connect()
                if self.source is not None and s.backend.capabilities.registered_layout:
                    s.register_layout(self.source)       # once per process: the backend shares it
            except KVRelayError as exc:
                s.close()
                lane.down_until, lane.down_reason = time.monotonic() + DOWN_S, str(exc)
                raise
            lane.sender = s
        return lane.sender

    def drop_sender(self, lane: Lane) -> None:
        s, lane.sender = lane.sender, None
        if s is not None:
            log.info("dropping the session to %s; the next push reconnects", lane.endpoint)
            with contextlib.suppress(KVRelayError):
                s.close()

    def close(self) -> None:
        """Join every lane's thread (the worker has told them to stop) and close its Sender."""
        for lane in list(self._lanes.values()):
            if lane.thread is not None:
                lane.thread.join(timeout=5)
            self.drop_sender(lane)
