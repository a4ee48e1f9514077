"""The shared store tiers against a writer without the secret, and Redis with AUTH (real redis-server)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvrelay.bench.local_redis import REDIS, redis_server
from kvrelay.core import config as kcfg
from kvrelay.store.records import seal_for
from kvrelay.store.store import MultiTierStore
from kvrelay.store.tiers import DiskTier, RedisTier
from tests.store.test_store import record

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (deploy/setup.sh installs it)")
SEAL = seal_for(os.environ["KVRELAY_SECRET"].encode())


def test_a_poisoned_redis_record_is_a_counted_miss(tmp_path: Path):
    with redis_server(tmp_path) as (url, _):
        tier = RedisTier(url, seal=SEAL)
        (k1, r1), (k2, r2) = record(21, 9000), record(22, 9000)
        assert tier.put([(k1, r1)]) == 1
        # An attacker with Redis access writes a well-formed record (valid header and xxh3) for a prefix
        # every user shares: with no MAC, with a MAC under another key, and as a copy of another key's record.
        poisoned = [r2, seal_for(b"not-this-deployment-secret").seal(k2, r2), tier.client.get(tier._k(k1))]
        for value in poisoned:
            tier.client.set(tier._k(k2), value)
            assert tier.get([k1, k2]) == [r1, None]
        assert tier.forged == 3
        assert tier.client.exists(tier._k(k2)) == 0               # dropped, not served to the next user
        store = MultiTierStore(1 << 20, redis_url=url, seal=SEAL)   # the store's lookup sees a miss too
        tier.client.set(tier._k(k2), r2)
        assert store.redis is not None and store.redis.get([k2]) == [None]
        store.close()


def test_a_poisoned_disk_record_is_a_counted_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, 1 << 20, seal=SEAL)
    (k1, r1) = record(31)
    (tmp_path / f"{k1.hex()}.kvc").write_bytes(r1)               # planted without a MAC
    assert disk.get([k1]) == [None] and disk.forged == 1


def test_redis_with_a_password_from_a_0600_file(tmp_path: Path):
    pw_file = tmp_path / "redis-password"
    pw_file.write_text("s3cret-redis-password\n")
    pw_file.chmod(0o600)
    with redis_server(tmp_path, password="s3cret-redis-password") as (url, _):
        cfg = kcfg.from_dict({"store": {"enabled": True, "redis_url": url, "redis_password_file": str(pw_file)}})
        tier = RedisTier(url, seal=SEAL, password=cfg.store.redis_password())
        (k, r) = record(41)
        assert tier.put([(k, r)]) == 1 and tier.get([k]) == [r]
        anonymous = RedisTier(url, seal=SEAL)                       # no password: refused by Redis = a miss
        assert anonymous.get([k]) == [None] and anonymous.errors == 1
        assert "s3cret" not in url


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_redis_over_tls_verifies_the_server(tmp_path: Path):
    with redis_server(tmp_path, tls=True, password="tls-and-auth") as (url, _):
        assert url.startswith("rediss://")
        tier = RedisTier(url, seal=SEAL, password="tls-and-auth", ca_file=str(tmp_path / "redis-ca.pem"))
        (k, r) = record(51)
        assert tier.put([(k, r)]) == 1 and tier.get([k]) == [r]
        plain = RedisTier(url.replace("rediss://", "redis://"), seal=SEAL, password="tls-and-auth")
        assert plain.get([k]) == [None] and plain.errors == 1          # no TLS: no answer, a miss
        unverified = RedisTier(url, seal=SEAL, password="tls-and-auth")   # the system CAs do not know it
        assert unverified.get([k]) == [None] and unverified.errors == 1
