"""What the router checks before it starts, as a list of problems rather than the first one.

``kvrelay router`` raises on the first problem (:func:`require`); ``kvrelay config --check``
prints them all (:func:`problems`). Each check reads only the config and the files it names,
so it runs the same on an operator's laptop as on the router host.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import load_secret
from kvrelay.core.config import KVRelayConfig, RoutingPolicy
from kvrelay.router.limits import ApiKeys


def tls_context(cfg: KVRelayConfig) -> ssl.SSLContext | None:
    """HTTPS for clients when ``router.tls_cert`` and ``router.tls_key`` are set."""
    rc = cfg.router
    if not rc.tls_cert and not rc.tls_key:
        return None
    if not (rc.tls_cert and rc.tls_key):
        raise ConfigError("router.tls_cert and router.tls_key must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(rc.tls_cert, rc.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"router TLS: cannot load {rc.tls_cert} / {rc.tls_key}: {exc}") from exc
    return ctx


def _nodes(cfg: KVRelayConfig) -> None:
    if not cfg.router.prefill or not cfg.router.decode:
        raise ConfigError("router: router.prefill and router.decode must list at least one node each")


def _cache_aware(cfg: KVRelayConfig) -> None:
    rc = cfg.router
    if rc.policy is not RoutingPolicy.CACHE_AWARE:
        return
    if not any("=" in entry for entry in rc.prefill):
        raise ConfigError("router.policy cache_aware needs the prefill nodes' store events: list each as "
                          "URL=tcp://HOST:PORT (or dns+http://NAME:PORT=tcp://NAME:PORT) in router.prefill, "
                          "PORT being the nodes' store.publish_port")
    if not rc.tokenizer:
        raise ConfigError("router.policy cache_aware needs router.tokenizer (the model path)")


CHECKS: dict[str, Callable[[KVRelayConfig], object]] = {
    "nodes": _nodes,
    "secret": lambda cfg: load_secret(cfg.transport),
    "api_keys": lambda cfg: ApiKeys.from_config(cfg.router),
    "tls": tls_context,
    "cache_aware": _cache_aware,
}


def problems(cfg: KVRelayConfig, skip: frozenset[str] = frozenset()) -> list[str]:
    """Every reason the router would refuse to start with ``cfg`` (empty: it would start);
    ``skip`` names checks (keys of CHECKS) that do not apply, e.g. the node lists ``kvrelay up`` fills in."""
    found = []
    for name, check in CHECKS.items():
        if name in skip:
            continue
        try:
            check(cfg)
        except ConfigError as exc:
            found.append(str(exc))
    return found


def require(cfg: KVRelayConfig) -> None:
    """Raise ConfigError naming the first problem, if any."""
    for check in CHECKS.values():
        check(cfg)
