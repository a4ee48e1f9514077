"""The ``kv_transfer_params`` schema: what the router puts into both requests of a PD pair.

``{"kvrelay": {...}}`` carries :class:`PushParams` to the prefill node and
:class:`PullParams` to the decode node. Versioned and validated: anything else is a
:class:`ParamsError` naming what is wrong.

The router signs each one (:class:`ParamsSigner`): an HMAC under the deployment's
params key over every field, including an expiry. Engines accept only signed, unexpired
params (:class:`ParamsVerifier`), and a prefill node pushes only to a decode endpoint in
its allowlist, so a client that reaches an engine directly can neither aim a push at an
address of its choosing nor name another request's transfer.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvrelay.common.errors import KVRelayError
from kvrelay.common.secrets import KeyUse, derive_key, mac, same

log = logging.getLogger("kvrelay.params")

PARAMS_KEY = "kvrelay"
PARAMS_REFUSED_HEADER = "X-Kvrelay-Params-Refused"   # on an engine's 400 for refused params: the cause
PARAMS_VERSION = 2          # 2: signed (exp, sig)


class ParamsRefusal(str, enum.Enum):
    """Why an engine refused a request's ``kv_transfer_params`` (a metric label)."""

    MALFORMED = "malformed"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    NOT_ALLOWED = "not_allowed"      # push_to is not a decode node this prefill node may push to
    WRONG_ROLE = "wrong_role"        # push params sent to a decode node, or pull params to a prefill node
    REUSED = "reused"                # a transfer_id already in use on this node


class ParamsError(KVRelayError, ValueError):
    """Malformed or refused ``kv_transfer_params``; ``cause`` says which."""

    def __init__(self, message: str, cause: ParamsRefusal = ParamsRefusal.MALFORMED) -> None:
        super().__init__(message)
        self.cause = cause


class PushParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="push", tag_field="role"):
    """For the prefill node: compute the prompt and push its chunks to ``push_to``."""

    transfer_id: str
    push_to: str                 # the decode node's transfer control endpoint, tcp://host:port
    early: bool = False          # D's request follows P's answer (first token from P): push without waiting
    exp: float = 0.0             # unix time after which the params are refused
    sig: str = ""                # hex HMAC over every other field (ParamsSigner)
    v: int = PARAMS_VERSION


class PullParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="pull", tag_field="role"):
    """For the decode node: the prompt's KV arrives from a prefill node under ``transfer_id``."""

    transfer_id: str
    pull_from: str = ""          # informational: the prefill node's URL
    tail: int = 0                # the prompt's last `tail` tokens are not in the transfer (token 1 from P): D computes them
    exp: float = 0.0
    sig: str = ""
    v: int = PARAMS_VERSION


Params = PushParams | PullParams
_encoder = msgspec.msgpack.Encoder()


def parse_params(kv_transfer_params: dict[str, Any] | None) -> Params | None:
    """Extract kvrelay's params from a request's ``kv_transfer_params`` (None if absent).
    Checks the schema only; :class:`ParamsVerifier` checks the signature."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    try:
        params = msgspec.convert(kv_transfer_params[PARAMS_KEY], Params)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"invalid kv_transfer_params.{PARAMS_KEY}: {exc}") from exc
    if params.v != PARAMS_VERSION:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} version {params.v}; this node speaks "
                          f"{PARAMS_VERSION}")
    if not params.transfer_id:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.transfer_id is empty")
    result: PushParams | PullParams | None = params
    return result


def params_dict(params: Params) -> dict[str, Any]:
    return {PARAMS_KEY: msgspec.to_builtins(params)}


def _signature(key: bytes, params: Params) -> str:
    return mac(key, b"kv_transfer_params", _encoder.encode(msgspec.structs.replace(params, sig=""))).hex()


class ParamsSigner:
    """The router's half: signs params for ``ttl_s`` seconds."""

    def __init__(self, secret: bytes, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._key, self._ttl, self._clock = derive_key(secret, KeyUse.PARAMS), ttl_s, clock

    def sign(self, params: Params) -> Params:
        params = msgspec.structs.replace(params, exp=self._clock() + self._ttl, sig="")
        return msgspec.structs.replace(params, sig=_signature(self._key, params))


class PushAllowlist:
    """The decode transfer endpoints (``tcp://host:port``) a prefill node may push to.

    An entry naming a host (``tcp://kvrelay-decode.ns.svc:9100``, a headless Service) allows
    every address the name resolves to, so pods that come and go stay allowed. Names are
    resolved off the request path: once when the list is made, then every ``ttl_s`` by a
    background thread (:meth:`start`); a membership test only reads the last answers, so it
    never waits on DNS. A failed or empty lookup keeps the last good answer (a DNS blip refuses
    no push). The resolver is injected (``resolve(host) -> addresses``); :meth:`refresh` is
    what the thread calls.
    """

    def __init__(self, entries: Collection[str], *, ttl_s: float = 5.0,
                 resolve: Callable[[str], Collection[str]] | None = None) -> None:
        self._exact = frozenset(entries)
        self._named = [(u.hostname, u.port) for u in map(urlsplit, entries)
                       if u.hostname and not _is_ip(u.hostname)]
        self._ttl = ttl_s
        self._resolve = resolve or _resolve_host
        self._addrs: dict[str, frozenset[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def __contains__(self, endpoint: object) -> bool:
        if endpoint in self._exact:
            return True
        u = urlsplit(str(endpoint))
        return any(port == u.port and u.hostname in self._addrs.get(name, ()) for name, port in self._named)

    def refresh(self) -> None:
        """Resolve every named entry once; a lookup that fails or finds nothing keeps the last answer."""
        for name, _ in self._named:
            try:
                addrs = frozenset(self._resolve(name))
            except OSError as exc:
                log.warning("push allowlist: resolving %s failed (%s); keeping its last addresses", name, exc)
                continue
            if addrs:
                self._addrs[name] = addrs        # one assignment: readers see the old set or the new

    def start(self) -> PushAllowlist:
        """Refresh in the background every ``ttl_s`` (only if some entry names a host)."""
        if self._named and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvrelay-allowlist-dns", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._ttl):
            self.refresh()

    def close(self) -> None:
        self._stop.set()


def _parses(parse: Callable[[str], object], text: str) -> bool:
    """Whether ``parse(text)`` accepts ``text`` (ValueError = no)."""
    try:
        parse(text)
    except ValueError:
        return False
    return True


def _is_ip(host: str) -> bool:
    return _parses(ipaddress.ip_address, host)


def _resolve_host(name: str) -> frozenset[str]:
    return frozenset(str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))


class ParamsVerifier:
    """An engine's half: parses and verifies a request's params.

    ``role`` is the kind this node accepts (PushParams on prefill, PullParams on decode);
    ``allowed_push``: the decode endpoints a prefill node may push to (None = any signed one).
    """

    def __init__(self, secret: bytes, role: type[PushParams] | type[PullParams], *,
                 allowed_push: Collection[str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self._key, self._role, self._clock = derive_key(secret, KeyUse.PARAMS), role, clock
        self._allowed = PushAllowlist(allowed_push).start() if allowed_push else None

    def check(self, kv_transfer_params: dict[str, Any] | None) -> Params | None:
        """The verified params (None if the request has none); ParamsError with its cause."""
        params = parse_params(kv_transfer_params)
        if params is None:
            return None
        if not isinstance(params, self._role):
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}: {type(params).__name__} sent to a node that "
                              f"takes {self._role.__name__}", ParamsRefusal.WRONG_ROLE)
        if not params.sig:
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} is not signed; only the kvrelay router may "
                              "send transfer params", ParamsRefusal.UNSIGNED)
        if not same(bytes.fromhex(params.sig) if _is_hex(params.sig) else b"", bytes.fromhex(
                _signature(self._key, params))):
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} has a bad signature", ParamsRefusal.BAD_SIGNATURE)
        if params.exp < self._clock():
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} expired", ParamsRefusal.EXPIRED)
        if isinstance(params, PushParams) and self._allowed is not None and params.push_to not in self._allowed:
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.push_to {params.push_to!r} is not a decode node "
                              "this prefill node may push to (transport.allowed_decode)", ParamsRefusal.NOT_ALLOWED)
        return params

    def close(self) -> None:
        """Stop the allowlist's DNS refresher (if any)."""
        if self._allowed is not None:
            self._allowed.close()


def _is_hex(text: str) -> bool:
    return _parses(bytes.fromhex, text)
