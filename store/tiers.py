"""Storage tiers of the multi-tier KV store, all addressed by 32-byte chunk key.

A stored chunk is a *record* (:mod:`kvrelay.store.records` owns the format). Every
tier checks a record when it reads it back; a record that fails (a flipped bit on
disk, a truncated Redis value, a record stored under the wrong key) is dropped and
reported as a miss, never returned.

* :class:`DiskTier` - one file per key, written to a temp file then renamed (a crash
  never leaves a half-written record under a real name), with a byte cap. The
  filesystem may fill below the cap (it is shared, or the cap is set too high): a write
  that finds it full evicts the tier's oldest records and is tried once more, so the
  tier keeps taking new chunks instead of keeping old ones for good.
* :class:`RedisTier` - a real Redis server (binary-safe values, optional TTL, a
  connection pool, one pipelined round trip per batch). A server that goes away
  degrades to misses with a logged warning; it never fails a request. After an outage
  the tier is skipped (instant misses, no connection attempts) for ``retry_s``, so an
  unreachable server costs one socket timeout per ``retry_s``, not one per lookup.

The CPU tier lives in :mod:`kvrelay.store.store` (it owns the reference-counted buffers).
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvrelay.store.policy import Policy, make_policy
from kvrelay.store.records import RecordSeal, check_record

log = logging.getLogger("kvrelay.store")


class Tier(abc.ABC):
    """A key -> record map. Batch methods are the interface: one round trip per batch."""

    name: str
    seal: RecordSeal
    forged: int = 0          # records refused for a bad MAC (written without the deployment's secret)
    corrupt: int = 0         # records with a valid MAC that fail their own checks

    def _verified(self, key: bytes, sealed: bytes) -> bytes | None:
        """The record inside ``sealed`` if its MAC and its own checks pass; else None (counted, logged)."""
        record = self.seal.open(key, sealed)
        if record is None:
            self.forged += 1
            log.warning("%s tier: record %s has no valid MAC (not written by this deployment); dropped",
                        self.name, key.hex()[:16])
            return None
        data = bytes(record)
        if not check_record(key, data):
            self.corrupt += 1
            log.warning("%s tier: corrupt record %s dropped", self.name, key.hex()[:16])
            return None
        return data

    @abc.abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present (no verification; a later get may still miss)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified records, None for missing or corrupt ones (corrupt ones are deleted)."""

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        """Store records; returns how many were stored. Never raises for tier outages."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class DiskTier(Tier):
    name = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, policy: str = "lru", *,
                 seal: RecordSeal) -> None:
        self.seal = seal
        self.forged = 0          # records whose MAC did not verify (written without the secret)
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: dict[bytes, int] = {}
        self._policy: Policy = make_policy(policy)
        self.corrupt = 0
        self.failed_writes = 0   # consecutive writes that failed (a full or broken filesystem)
        for f in sorted(self.root.glob("*.kvc"), key=lambda p: p.stat().st_mtime):   # survive restarts
            key = bytes.fromhex(f.stem)
            self._sizes[key] = f.stat().st_size
            self._policy.insert(key)
        for stale in self.root.glob("*.tmp"):
            stale.unlink(missing_ok=True)

    def _file(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}.kvc"

    @property
    def used(self) -> int:
        return sum(self._sizes.values())

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._sizes for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                sealed = self._file(key).read_bytes()
            except OSError:
                out.append(None)
                continue
            data = self._verified(key, sealed)
            if data is None:
                self._drop(key)
                out.append(None)
                continue
            with self._lock:
                self._policy.access(key)
            out.append(data)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        stored = 0
        for key, record in items:
            n = memoryview(record).nbytes + RecordSeal.SIZE
            if n > self.capacity:
                continue
            with self._lock:
                if key in self._sizes:
                    self._policy.access(key)
                    continue
                self._evict(self.used + n - self.capacity)
            if not self._write(key, self.seal.seal(key, record)):
                continue
            with self._lock:
                self._sizes[key] = n
                self._policy.insert(key)
            stored += 1
        return stored

    def _write(self, key: bytes, sealed: bytes) -> bool:
        """Write one record (temp file, then rename). A full filesystem (ENOSPC, EDQUOT) evicts
        the oldest records - as many bytes as this one - and tries once more."""
        tmp = self.root / f"{key.hex()}.{threading.get_ident()}.tmp"
        for attempt in (1, 2):
            try:
                with open(tmp, "wb") as f:
                    f.write(sealed)
                os.replace(tmp, self._file(key))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                with self._lock:
                    if full and attempt == 1 and self._evict(len(sealed)):
                        continue
                self._failed(key, exc)
                return False
            if self.failed_writes:
                log.warning("disk tier: writing again after %d failed writes", self.failed_writes)
                self.failed_writes = 0
            return True
        return False

    def _failed(self, key: bytes, exc: OSError) -> None:
        """Log the first failure of a streak (a full disk fails every write until room is made)."""
        self.failed_writes += 1
        if self.failed_writes == 1:
            log.warning("disk tier: cannot write %s: %s (further failures are counted, not logged)",
                        key.hex()[:16], exc)

    def _evict(self, nbytes: int) -> int:
        """Evict records, the policy's victims first, until ``nbytes`` are freed (lock held).
        Returns the bytes freed."""
        freed = 0
        while self._sizes and freed < nbytes:
            victim = self._policy.victim(lambda k: True)
            if victim is None:
                break
            self._file(victim).unlink(missing_ok=True)
            freed += self._sizes.pop(victim, 0)
            self._policy.remove(victim)
        return freed

    def _drop(self, key: bytes) -> None:
        self._file(key).unlink(missing_ok=True)
        with self._lock:
            if self._sizes.pop(key, None) is not None:
                self._policy.remove(key)


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, *, seal: RecordSeal, password: str | None = None, ca_file: str = "",
                 ttl_s: int = 0, prefix: bytes = b"kvrelay:", timeout_s: float = 1.0,
                 retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``url``: ``redis://`` or ``rediss://`` (TLS; ``ca_file`` verifies the server). ``password``
        overrides one in the URL (ACL users: ``redis://user@host``)."""
        import redis

        self._redis = redis
        self.seal = seal
        self.forged = 0
        extra: dict[str, Any] = {"password": password} if password else {}
        if url.startswith("rediss://") and ca_file:
            extra["ssl_ca_certs"] = ca_file
        self.pool = redis.ConnectionPool.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                  **extra)
        self.client = redis.Redis(connection_pool=self.pool)
        self.ttl = ttl_s
        self.prefix = prefix
        self.retry_s, self._clock = retry_s, clock
        self._down_until = 0.0
        self.corrupt = 0
        self.errors = 0        # failed round trips
        self.skipped = 0       # calls answered as misses while the tier was marked down

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key

    def _down(self) -> bool:
        if self._clock() < self._down_until:
            self.skipped += 1
            return True
        return False

    def _outage(self, what: str, exc: Exception) -> None:
        self.errors += 1
        self._down_until = self._clock() + self.retry_s
        log.warning("redis tier unavailable during %s (%s); treating it as a miss for %.3g s", what, exc,
                    self.retry_s)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if self._down():
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(x) for x in pipe.execute()]
        except self._redis.RedisError as exc:
            self._outage("lookup", exc)
            return [False] * len(keys)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys or self._down():
            return [None] * len(keys)
        try:
            values = self.client.mget([self._k(k) for k in keys])
        except self._redis.RedisError as exc:
            self._outage("get", exc)
            return [None] * len(keys)
        out: list[bytes | None] = []
        for key, raw in zip(keys, values, strict=True):
            value = self._verified(key, raw) if isinstance(raw, bytes) else None
            if isinstance(raw, bytes) and value is None:
                self._delete(key)
            out.append(value)
        return out

    def _delete(self, key: bytes) -> None:
        try:
            self.client.delete(self._k(key))
        except self._redis.RedisError as exc:
            self._outage("delete", exc)

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        if not items or self._down():
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, record in items:
                pipe.set(self._k(key), self.seal.seal(key, record), ex=self.ttl or None)
            pipe.execute()
        except self._redis.RedisError as exc:
            self._outage("put", exc)
            return 0
        return len(items)

    def close(self) -> None:
        self.pool.disconnect()


def first_missing(present: Iterable[bool]) -> int:
    """Length of the leading run of True."""
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n
