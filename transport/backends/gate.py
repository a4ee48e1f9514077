"""The data port's gate: accept connections and read their preambles, all on one thread.

A connection to a socket backend's data port proves itself with a preamble before anything
else on it is read (:mod:`kvrelay.transport.backends.sockets`). Until it has, it costs the
receiver a file descriptor and a few bytes of buffer - never a thread:

* one thread accepts and reads every pending preamble through a selector, without blocking;
* each connection has **one overall deadline** (``deadline_s`` from its accept), so a peer
  that trickles a byte every few seconds is closed as surely as one that sends nothing;
* at most ``max_pending`` connections wait for their preamble; a new one beyond that closes
  the oldest (an honest sender writes its preamble with its connect, so it is read at once);
* accepting never stops on an error: out of descriptors (``EMFILE``/``ENFILE``), the oldest
  pending connection is closed to make room, or the gate backs off for a moment; a thread
  that cannot be started for an authenticated connection closes that connection only.

Refusals are reported through ``refused(reason)``; an authenticated connection goes to
``serve(conn, sender)`` in a thread of its own (one per sender). The clock is injectable.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass
class _Pending:
    conn: socket.socket
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class Gate:
    """Accepts on ``lsock`` and admits connections whose preamble ``check`` accepts."""

    def __init__(self, lsock: socket.socket, *, need: Callable[[bytes], int], check: Callable[[bytes], str | None],
                 serve: Callable[[socket.socket, str], None], refused: Callable[[str], None],
                 on_accept: Callable[[socket.socket], None] = lambda conn: None, deadline_s: float = 5.0,
                 max_pending: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        """``need(buf)``: how many bytes the preamble has, judging by the ``buf`` that arrived so far
        (at least one more than ``len(buf)`` until it is known; ValueError for one that can never be
        valid); ``check(preamble)``: the sender it names, or None (``check`` counts its refusals)."""
        self._lsock, self._need, self._check, self._serve, self._refused = lsock, need, check, serve, refused
        self._on_accept, self.deadline_s, self.max_pending, self._clock = on_accept, deadline_s, max_pending, clock
        self._pending: dict[socket.socket, _Pending] = {}      # insertion order = accept order
        self._sel = selectors.DefaultSelector()
        self._closed = threading.Event()
        self.fd_exhaustions = 0                      # accepts that failed for want of a descriptor
        lsock.setblocking(False)
        self._sel.register(lsock, selectors.EVENT_READ)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        """The gate's loop (its own thread) until :meth:`close`."""
        while not self._closed.is_set():
            try:
                ready = self._sel.select(timeout=self._next_timeout())
            except (OSError, ValueError):            # the selector was closed under us
                break
            for key, _ in ready:
                if key.fileobj is self._lsock:
                    self._accept()
                else:
                    self._read(self._pending.get(key.fileobj))  # type: ignore[call-overload]
            self._expire()
        for p in list(self._pending.values()):
            self._drop(p, "")

    def close(self) -> None:
        self._closed.set()

    def _next_timeout(self) -> float:
        if not self._pending:
            return 0.5
        first = next(iter(self._pending.values()))
        return min(0.5, max(0.0, first.deadline - self._clock()))

    def _accept(self) -> None:
        for _ in range(64):                          # a burst per wake-up, then the pending reads get a turn
            try:
                conn, _ = self._lsock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._out_of_fds(exc)
                elif not self._closed.is_set():
                    log.warning("data port: accept failed (%s); still accepting", exc)
                return
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending.values())), "too many connections without a preamble")
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                self._on_accept(conn)
            self._pending[conn] = _Pending(conn, self._clock() + self.deadline_s)
            self._sel.register(conn, selectors.EVENT_READ)

    def _out_of_fds(self, exc: OSError) -> None:
        self.fd_exhaustions += 1
        if self.fd_exhaustions == 1:
            log.warning("data port: out of file descriptors (%s); closing the oldest connections without a "
                        "preamble, still accepting (raise RLIMIT_NOFILE?)", exc.strerror)
        if self._pending:
            self._drop(next(iter(self._pending.values())), f"out of file descriptors ({exc.strerror})")
        else:
            time.sleep(0.05)

    def _read(self, p: _Pending | None) -> None:
        if p is None:
            return
        try:
            need = self._need(bytes(p.buf))
            data = p.conn.recv(need - len(p.buf))    # never past the preamble: chunk frames may follow it
        except BlockingIOError:
            return
        except (OSError, ValueError) as exc:
            self._drop(p, f"data connection preamble: {exc}")
            return
        if not data:
            self._drop(p, "")                         # closed before its preamble: nothing to count
            return
        p.buf += data
        try:
            if len(p.buf) == self._need(bytes(p.buf)):
                self._admit(p)
        except ValueError as exc:
            self._drop(p, f"data connection preamble: {exc}")

    def _admit(self, p: _Pending) -> None:
        self._forget(p)
        sender = self._check(bytes(p.buf))
        if sender is None:
            _close(p.conn)
            return
        p.conn.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(p.conn, sender), name="kvrelay-sock-rx", daemon=True).start()
        except RuntimeError as exc:                  # can't start new thread: this connection only
            self._refused(f"data connection of {sender!r} dropped: {exc}")
            _close(p.conn)

    def _expire(self) -> None:
        now = self._clock()
        while self._pending:
            first = next(iter(self._pending.values()))
            if first.deadline > now:
                return
            self._drop(first, f"data connection preamble not complete within {self.deadline_s:g} s")

    def _drop(self, p: _Pending, reason: str) -> None:
        self._forget(p)
        _close(p.conn)
        if reason:
            self._refused(reason)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(p.conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
