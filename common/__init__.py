"""kvrelay's ground floor: the primitives every other package uses.

Owns the one error hierarchy (``errors``: ``KVRelayError`` and below), the config types
every section is built from (``config``), chunk keys (``keys``), the versioned wire
header and its checksum (``wire``), the deployment secret and the keys derived from it
(``secrets``), listening ZeroMQ sockets (``listen``) and the polling helpers (``polling``).

May import: nothing of kvrelay's, and no engine (no vLLM, no torch).
"""
