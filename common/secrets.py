"""The deployment's shared secret: where it comes from, and the keys derived from it.

One secret per deployment authenticates every party: the transfer Hello, the router's
signature on ``kv_transfer_params`` and the MAC on shared store records. It never
travels on a command line or in a config file; a node reads it, in this order, from

1. the environment variable ``KVRELAY_SECRET`` (the value itself), or
2. ``transport.secret_file``: a file readable by its owner only (mode 0600 or 0400).

There is no default: a node without a secret refuses to start (:class:`ConfigError`
says how to set one). Each use gets its own key (:func:`derive_key`), so a key that
leaks from one mechanism (say, a store record MAC) opens no other.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Protocol

from kvrelay.common.errors import ConfigError

SECRET_ENV = "KVRELAY_SECRET"
API_KEY_ENV = "KVRELAY_API_KEY"    # clients' bearer key for the router (kvrelay.router.limits); the router's alone
MIN_SECRET_BYTES = 16
HOW_TO = (f"set {SECRET_ENV} in the environment, or transport.secret_file to a 0600 file; "
          "`kvrelay secret FILE` writes a new one (kvrelay up makes one per stack)")


class SecretSource(Protocol):
    """Where a section names the secret file (``TransportConfig`` is one)."""

    @property
    def secret_file(self) -> str: ...


class KeyUse(bytes, enum.Enum):
    """What a derived key is for (its derivation label)."""

    HELLO = b"kvrelay/hello/v1"          # control-plane challenge-response, both directions
    SESSION = b"kvrelay/session/v1"      # per-connection message MACs and the data-plane token
    PARAMS = b"kvrelay/params/v1"        # the router's signature on kv_transfer_params
    STORE = b"kvrelay/store/v1"          # MAC on records in the shared store tiers
    EVENTS = b"kvrelay/events/v1"        # salts the chunk keys store events publish
    DATA = b"kvrelay/data/v1"            # MAC on data frames (transport.data_mac)


def generate_secret() -> str:
    """A new random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0600, readable by no one else at any moment."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)            # O_CREAT's mode does not apply to an existing file
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return p


def write_secret_file(path: str | os.PathLike[str], secret: str | None = None) -> Path:
    """Create ``path`` with mode 0600 holding ``secret`` (a new one by default)."""
    return write_private(path, (secret or generate_secret()) + "\n")


def load_secret(transport: SecretSource, environ: os._Environ[str] | dict[str, str] | None = None) -> bytes:
    """The secret from ``KVRELAY_SECRET`` or ``transport.secret_file``; ConfigError if neither."""
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV, "")
    source = SECRET_ENV
    if not value and transport.secret_file:
        value, source = _read_secret_file(Path(transport.secret_file).expanduser()), "transport.secret_file"
    if not value:
        raise ConfigError(f"no shared secret: {HOW_TO}")
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(f"the shared secret from {source} is shorter than {MIN_SECRET_BYTES} bytes; {HOW_TO}")
    return value.encode()


def _read_secret_file(path: Path) -> str:
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"transport.secret_file {path}: {exc.strerror or exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"transport.secret_file {path} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):03o}); chmod 600 it")
    return text


def derive_key(secret: bytes, use: KeyUse) -> bytes:
    """The key for one use of the secret (HMAC-SHA256 as a PRF, labelled by ``use``)."""
    return hmac.new(secret, use.value, hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed ``parts`` (no two part lists collide)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a, b)
