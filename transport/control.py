"""The decode node's control endpoint: one ZeroMQ ROUTER socket, bound on a context of its own.

Contract:

* ``ControlSocket(host, port, max_message_bytes)`` binds ``tcp://host:port`` (``port`` 0: a
  free port, reported in ``endpoint``) or raises :class:`TransportError` with nothing left
  open. Messages over ``max_message_bytes`` (plus framing) are dropped by ZeroMQ itself.
* The socket belongs to the receiver's control thread; this class only owns its lifetime.
* ``close()`` blocks until the port is unbound, so a receiver restarted in the same process
  binds it again at once. ZeroMQ closes a socket's listener on its I/O thread after
  ``Socket.close`` returns, and only ``Context.term`` waits for that - hence the private
  context (the process-wide one cannot be terminated while senders use it).
"""

from __future__ import annotations

import zmq

from transport.errors import TransportError

_FRAMING_BYTES = 4096                      # room for the envelope around the largest message


class ControlSocket:
    def __init__(self, host: str, port: int, max_message_bytes: int) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + _FRAMING_BYTES)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind the control endpoint tcp://{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{host}:{port}"

    def close(self) -> None:
        """Close the socket and wait until its port is free. Idempotent."""
        if not self._ctx.closed:
            self.sock.close(linger=0)
            self._ctx.term()
