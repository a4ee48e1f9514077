"""The multi-tier store's settings (``store:`` in the tree), owned by the store.

Same role as ``transport/config.py`` and ``core/config.py``: a room's own config sections.
"""

from __future__ import annotations

import enum

from kvrelay.common.config_fields import MiB, NonNeg, Port, Seconds, Section, Size
from kvrelay.common.errors import ConfigError


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"


class StoreConfig(Section, frozen=True):
    """The multi-tier KV store (CPU / disk / Redis)."""

    enabled: bool = False            # prefill nodes store computed chunks and load stored prefixes
    cpu_bytes: Size = 1024 * MiB
    deferred_bytes: Size = 8 * MiB
    prefetch_ahead: NonNeg = 2
    lookup_timeout_s: Seconds = 2.0  # the scheduler's prefix lookup; slower than this = a miss (computed)
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    disk_path: str = ""
    disk_bytes: Size = 0
    redis_url: str = ""              # redis:// or rediss:// (TLS); no password here (it reaches command lines)
    redis_password_file: str = ""    # 0600 file with the Redis password (AUTH / ACL user's password)
    redis_ca_file: str = ""          # rediss://: CA bundle that verifies the server
    publish_port: Port = 0           # ZeroMQ PUB of chunk stored/evicted events for the router (0 = off)
    publish_host: str = ""           # where that PUB binds ("" = transport.host)
    save_decoded: bool = False       # decode nodes store the chunks their generated tokens complete (Redis)
    epoch: NonNeg = 0                # part of every chunk key: raise it to drop every stored record at once

    def __post_init__(self) -> None:
        super().__post_init__()
        if _url_password(self.redis_url):
            raise ConfigError("store.redis_url must not carry a password (it would reach every engine's command "
                              "line); put it in a 0600 file and set store.redis_password_file")
        if self.enabled and self.save_decoded and not self.redis_url:
            raise ConfigError("store.save_decoded: prefill nodes can only find a decode node's chunks in a "
                              "shared tier; set store.redis_url")

    def redis_password(self) -> str | None:
        """The password from ``redis_password_file`` (None if unset)."""
        if not self.redis_password_file:
            return None
        from pathlib import Path

        try:
            return Path(self.redis_password_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"store.redis_password_file {self.redis_password_file}: {exc.strerror or exc}") from exc

    @property
    def active(self) -> bool:
        """Enabled with a non-empty CPU tier."""
        return self.enabled and int(self.cpu_bytes) > 0


def _url_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return bool(url) and urlsplit(url).password is not None
    except ValueError:                  # a malformed port: the Redis tier says so when it connects
        return False


FIELD_HELP: dict[str, str] = {
    'store.enabled': 'prefill nodes keep computed chunks in the store and load stored prompt prefixes instead of computing them',
    'store.cpu_bytes': 'multi-tier store: CPU tier capacity',
    'store.epoch': ('part of every chunk key and fingerprint: raise it (on every node) to retire every record '
                    'the disk and Redis tiers hold, e.g. after changing weights in place'),
    'store.deferred_bytes': 'multi-tier store: batch-and-defer buffer for new chunks',
    'store.prefetch_ahead': 'multi-tier store: chunks prefetched ahead of the one installing',
    'store.lookup_timeout_s': ("prefill scheduler: a store prefix lookup that takes longer than this counts as a miss "
                               "(the prompt is computed); the engine's step waits for it, so keep it short"),
    'store.eviction_policy': 'multi-tier store: lru, lfu or fifo',
    'store.disk_path': 'multi-tier store: disk tier directory ("" = no disk tier)',
    'store.disk_bytes': 'multi-tier store: disk tier size cap',
    'store.publish_port': 'prefill nodes publish chunk stored/evicted events here (ZeroMQ PUB) for cache-aware routing; '
                          '0 = off (kvrelay up under router.policy cache_aware: kv_base_port + 300 + node index)',
    'store.publish_host': ('address the store events publisher binds ("" = transport.host); it is unauthenticated, '
                           'keep it on the private network (published keys are salted with the deployment secret)'),
    'store.redis_url': 'multi-tier store: redis://[user@]host:port/db or rediss:// for TLS ("" = no Redis tier)',
    'store.redis_password_file': 'file (mode 0600) holding the Redis password; keeps it off command lines and configs',
    'store.redis_ca_file': 'rediss://: CA certificate file that verifies the Redis server',
    'store.save_decoded': ('decode nodes also store the chunks completed by generated tokens (into store.redis_url, '
                           'which the prefill nodes share), so the next turn finds the previous answer'),
}
