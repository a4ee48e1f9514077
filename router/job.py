"""One client request as the router carries it: its ids, its body, where it goes.

Ids (:class:`RequestIds`): the client's ``X-Request-Id`` is echoed back and logged, never
used as a key. Engines get it as their own ``X-Request-Id`` only when it is short plain
ASCII; transfer ids are always the router's own - bounded (well under the receiver's
256-character limit) and unique - so no header a client can send reaches the transport.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvrelay.router.pools import Node

_PLAIN = re.compile(r"[A-Za-z0-9._:@+=-]{1,64}")
_ECHO_MAX = 512


@dataclass(frozen=True)
class RequestIds:
    client: str       # echoed in the answer's X-Request-Id ("" = nothing to echo)
    engine: str       # the X-Request-Id the engines see (P's gets "-p")
    transfer: str     # the KV transfer's id: "kvr-" + 32 hex digits, + "-" + the client's id when plain

    @classmethod
    def make(cls, header: str | None) -> RequestIds:
        own = uuid.uuid4().hex
        raw = header or ""
        echo = raw if len(raw) <= _ECHO_MAX and raw.isprintable() and _encodable(raw) else ""
        plain = bool(_PLAIN.fullmatch(raw))
        engine = raw if plain else f"kvr-{own}"
        return cls(echo or engine, engine, f"kvr-{own}-{raw}" if plain else f"kvr-{own}")

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.client}


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:           # lone surrogates from a header that was not UTF-8
        return False
    return True


@dataclass
class Job:
    """What every path of one request needs (built once by the router, never shared)."""

    request: web.Request
    endpoint: str
    body: dict[str, Any]
    ids: RequestIds
    t0: float
    decode: Node

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def with_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))
