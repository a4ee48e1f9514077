"""A ZeroMQ socket that listens on a tcp port, on a context of its own.

Used for the decode node's control endpoint (ROUTER) and the store's event publisher (PUB).

Contract:

* ``ListeningSocket(kind, what, host, port, options)`` sets ``options`` (LINGER is always 0),
  then binds ``tcp://host:port`` (``port`` 0: a free port, reported in ``endpoint``) or raises
  :class:`TransportError` ("cannot bind <what> tcp://host:port: ...") with nothing left open.
* The socket belongs to its owner's thread(s); this class only owns its lifetime.
* ``close()`` blocks until the port is unbound, so an owner restarted in the same process binds
  it again at once. ZeroMQ closes a socket's listener on its I/O thread after
  ``Socket.close`` returns, and only ``Context.term`` waits for that - hence the private
  context (the process-wide one cannot be terminated while senders use it).
"""

from __future__ import annotations

from collections.abc import Mapping

import zmq

from kvrelay.common.errors import TransportError


class ListeningSocket:
    def __init__(self, kind: int, what: str, host: str, port: int,
                 options: Mapping[int, int] | None = None) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self.sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():
            self.sock.setsockopt(option, value)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind {what} tcp://{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{host}:{port}"

    def close(self) -> None:
        """Close the socket and wait until its port is free. Idempotent."""
        if not self._ctx.closed:
            self.sock.close(linger=0)
            self._ctx.term()
