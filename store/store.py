"""The multi-tier KV store: CPU (reference-counted buffers) over disk and Redis.

* **Store path (batch-and-defer).** :meth:`MultiTierStore.put` makes a chunk visible in
  the CPU tier at once (that is the acknowledgement) and queues its key; when the
  queued bytes reach ``deferred_bytes`` - or on :meth:`flush`/:meth:`close` - one
  background batch writes them to the lower tiers (one ``put`` per tier), reading the
  CPU buffers by reference: a chunk in several tiers has one CPU buffer. Closing
  flushes synchronously, so nothing acknowledged is lost.
* **Eviction.** The CPU tier evicts by ``eviction_policy`` and never evicts a chunk with
  a live reference (being read, being written down, installed right now). An evicted
  chunk is demoted to disk when a disk tier exists.
* **Load path.** :meth:`lookup_prefix` finds the longest run of leading keys present in
  any tier with one batched query per tier; :meth:`load` yields those chunks in order,
  keeping ``prefetch_ahead`` lower-tier reads in flight ahead of the one being
  consumed, and promotes them into the CPU tier.
* **Events.** ``on_event(kind, keys)`` (``"stored"`` / ``"evicted"``) feeds the router's
  cache-aware index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvrelay.common.errors import ConfigError
from kvrelay.store.policy import make_policy
from kvrelay.store.records import RecordSeal
from kvrelay.store.tiers import DiskTier, RedisTier, Tier, first_missing

log = logging.getLogger("kvrelay.store")

EventFn = Callable[[str, list[bytes]], None]


@dataclass
class _Entry:
    record: bytes | bytearray      # a bytearray was handed over by build_record: never changed
    refs: int = 0


@dataclass
class StoreStats:
    hits: dict[str, int] = field(default_factory=dict)          # chunks served, per tier
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    stored: int = 0
    evicted: int = 0
    misses: int = 0                                              # chunk reads no tier could serve
    demoted: int = 0
    flushed: int = 0


class CpuTier:
    """In-memory records with reference counts, a byte capacity and an eviction policy."""

    name = "cpu"

    def __init__(self, capacity_bytes: int, policy: str = "lru",
                 on_evict: Callable[[bytes, bytes | bytearray], None] | None = None) -> None:
        self.capacity = capacity_bytes
        self._entries: dict[bytes, _Entry] = {}
        self._policy = make_policy(policy)
        self._used = 0
        self._lock = threading.RLock()
        self._on_evict = on_evict

    @property
    def used(self) -> int:
        return self._used

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def put(self, key: bytes, record: bytes | bytearray) -> bool:
        """Insert (False if it cannot fit even after evicting every unreferenced chunk). The tier
        keeps ``record`` itself, not a copy: a bytearray is handed over (records.build_record)."""
        with self._lock:
            if key in self._entries:
                self._policy.access(key)
                return True
            if not self._make_room(len(record)):
                return False
            self._entries[key] = _Entry(record)
            self._used += len(record)
            self._policy.insert(key)
            return True

    def put_acquire(self, key: bytes, record: bytes | bytearray) -> memoryview | None:
        """Insert (or find) and reference in one step, so no other insert can evict it between."""
        with self._lock:
            if not self.put(key, record):
                return None
            return self.acquire(key)

    def acquire(self, key: bytes, *, touch: bool = True) -> memoryview | None:
        """A zero-copy view of the record; hold it until :meth:`release`. ``touch=False``
        (copying down to another tier) does not count as a use for the eviction policy."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            e.refs += 1
            if touch:
                self._policy.access(key)
            return memoryview(e.record)

    def release(self, key: bytes) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.refs > 0:
                e.refs -= 1

    def refs(self, key: bytes) -> int:
        with self._lock:
            e = self._entries.get(key)
            return e.refs if e else 0

    def _make_room(self, n: int) -> bool:
        while self._used + n > self.capacity:
            victim = self._policy.victim(lambda k: self._entries[k].refs == 0)
            if victim is None:
                return False
            e = self._entries.pop(victim)
            self._policy.remove(victim)
            self._used -= len(e.record)
            if self._on_evict is not None:
                self._on_evict(victim, e.record)
        return True


class MultiTierStore:
    def __init__(self, cpu_bytes: int, *, policy: str = "lru", disk_path: str = "", disk_bytes: int = 0,
                 redis_url: str = "", deferred_bytes: int = 8 << 20, prefetch_ahead: int = 2,
                 on_event: EventFn | None = None, seal: RecordSeal | None = None,
                 redis_password: str | None = None, redis_ca_file: str = "") -> None:
        """``seal`` keys the MAC on records in the shared tiers (required with disk or Redis)."""
        self.stats = StoreStats()
        if (disk_path and disk_bytes or redis_url) and seal is None:
            raise ConfigError("the disk and Redis store tiers need the deployment's secret (a RecordSeal)")
        self.disk = DiskTier(disk_path, disk_bytes, policy, seal=seal) if disk_path and disk_bytes and seal else None
        self.redis = (RedisTier(redis_url, seal=seal, password=redis_password, ca_file=redis_ca_file)
                      if redis_url and seal else None)
        self.lower: list[Tier] = [t for t in (self.disk, self.redis) if t is not None]
        self.cpu = CpuTier(cpu_bytes, policy, on_evict=self._evicted)
        self.deferred_bytes = deferred_bytes
        self.prefetch_ahead = prefetch_ahead
        self._on_event = on_event
        self._lock = threading.Lock()
        self._queue: list[bytes] = []
        self._queued_bytes = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-store-flush")
        self._readers = ThreadPoolExecutor(max_workers=max(1, prefetch_ahead), thread_name_prefix="kvrelay-store-read")
        self._pending: list[Future[None]] = []

    # ---------------------------------------------------------------- store path
    def put(self, key: bytes, record: bytes | bytearray) -> bool:
        """Acknowledge a chunk: in the CPU tier now, in the lower tiers at the next flush. The
        record is handed over (see :meth:`CpuTier.put`)."""
        if not self.cpu.put(key, record):
            log.warning("store: CPU tier full of referenced chunks; %s not stored", key.hex()[:16])
            return False
        self.stats.stored += 1
        self._emit("stored", [key])
        if self.lower:
            with self._lock:
                self._queue.append(key)
                self._queued_bytes += len(record)
                full = self._queued_bytes >= self.deferred_bytes
            if full:
                self.flush(wait=False)
        return True

    def flush(self, wait: bool = True) -> None:
        with self._lock:
            batch, self._queue, self._queued_bytes = self._queue, [], 0
        if batch:
            self._reap_done()
            self._pending.append(self._writer.submit(self._write_down, batch))
        if wait:
            for f in self._pending:
                f.result()
            self._pending.clear()

    def _reap_done(self) -> None:
        """Drop finished write-downs (a long-lived store would pile them up), logging failures."""
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            if f.exception() is not None:
                log.warning("store: a deferred write-down failed: %s", f.exception())

    def _write_down(self, keys: list[bytes]) -> None:
        views = [(k, self.cpu.acquire(k, touch=False)) for k in keys]   # by reference: no copies
        items = [(k, v) for k, v in views if v is not None]
        try:
            for tier in self.lower:
                tier.put(items)
            self.stats.flushed += len(items)
        finally:
            for k, v in views:
                if v is not None:
                    v.release()
                    self.cpu.release(k)

    def _evicted(self, key: bytes, record: bytes | bytearray) -> None:
        self.stats.evicted += 1
        if self.disk is not None and not self.disk.contains([key])[0]:
            self.disk.put([(key, memoryview(record))])
            self.stats.demoted += 1
        else:
            self._emit("evicted", [key])

    def _emit(self, kind: str, keys: list[bytes]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, keys)
            except Exception:  # noqa: BLE001 - an event sink must not break the store
                log.exception("store event sink failed")

    # ---------------------------------------------------------------- load path
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` present in some tier (one batched query per tier)."""
        present = self.cpu.contains(keys)
        for tier in self.lower:
            n = first_missing(present)
            if n == len(keys):
                break
            rest = tier.contains(keys[n:])
            present = present[:n] + [a or b for a, b in zip(present[n:], rest, strict=True)]
        return first_missing(present)

    def load(self, keys: Sequence[bytes]) -> Iterator[tuple[bytes, memoryview | None]]:
        """Yield ``(key, record view)`` in order; a None view ends the usable prefix.

        A yielded view stays valid (its chunk referenced, so never evicted) until the
        caller asks for the next one or closes the generator."""
        futures: dict[int, Future[tuple[memoryview | None, bool]]] = {}
        try:
            for i in range(len(keys)):
                for j in range(i, min(len(keys), i + 1 + self.prefetch_ahead)):
                    if j not in futures:
                        futures[j] = self._readers.submit(self._fetch, keys[j])
                view, held = futures.pop(i).result()
                try:
                    yield keys[i], view
                finally:
                    if held:
                        self.cpu.release(keys[i])
                if view is None:
                    break
        finally:
            for j, f in futures.items():
                if not f.cancel():
                    _, held = f.result()
                    if held:
                        self.cpu.release(keys[j])

    def _fetch(self, key: bytes) -> tuple[memoryview | None, bool]:
        """The record, referenced in the CPU tier when it fits there: (view, holds a CPU ref)."""
        view = self.cpu.acquire(key)
        if view is not None:
            self._count("cpu", len(view))
            return view, True
        for tier in self.lower:
            record = tier.get([key])[0]
            if record is not None:
                self._count(tier.name, len(record))
                held = self.cpu.put_acquire(key, record)
                return (held, True) if held is not None else (memoryview(record), False)
        self.stats.misses += 1
        return None, False

    def _count(self, tier: str, n: int) -> None:
        self.stats.hits[tier] = self.stats.hits.get(tier, 0) + 1
        self.stats.bytes_loaded[tier] = self.stats.bytes_loaded.get(tier, 0) + n

    def close(self) -> None:
        self.flush(wait=True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        for tier in self.lower:
            tier.close()
