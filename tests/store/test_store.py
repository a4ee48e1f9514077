"""Multi-tier store with a real redis-server and a real disk directory.

Records are real chunk records (wire header + payload), so every read back is checked
against the bytes that were stored, and corruption is caught by the wire checksum.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrelay.bench.local_redis import REDIS, free_port, redis_server
from kvrelay.common.keys import KEY_BYTES
from kvrelay.common.wire import make_header
from kvrelay.store.policy import make_policy
from kvrelay.store.records import seal_for
from kvrelay.store.store import CpuTier, MultiTierStore
from kvrelay.store.tiers import DiskTier, RedisTier

SEAL = seal_for(os.environ["KVRELAY_SECRET"].encode())


def record(i: int, size: int = 4096) -> tuple[bytes, bytes]:
    key = i.to_bytes(4, "big") * (KEY_BYTES // 4)
    payload = os.urandom(size)
    return key, make_header(key, "store", 0, [payload]).pack() + payload


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    if REDIS is None:
        pytest.skip("redis-server not installed (deploy/setup.sh installs it)")
    with redis_server(tmp_path_factory.mktemp("redis")) as (url, proc):
        yield url, proc


def test_store_evict_then_load_from_disk_is_byte_identical(tmp_path: Path):
    recs = [record(i) for i in range(8)]
    size = len(recs[0][1])
    s = MultiTierStore(3 * size, disk_path=str(tmp_path), disk_bytes=100 * size, deferred_bytes=100 * size, seal=SEAL)
    for k, r in recs:
        assert s.put(k, r)
    s.flush()
    assert s.cpu.contains([recs[0][0]]) == [False]          # evicted from CPU ...
    assert s.stats.evicted >= 5
    keys = [k for k, _ in recs]
    assert s.lookup_prefix(keys) == 8                        # ... but every chunk is still found
    got = []
    for _k, view in s.load(keys):
        assert view is not None
        got.append(bytes(view))
    assert got == [r for _, r in recs]
    assert s.stats.hits.get("disk", 0) >= 5
    s.close()


def test_deferred_writes_flush_in_batches_and_on_close(tmp_path: Path):
    recs = [record(i) for i in range(5)]
    size = len(recs[0][1])
    s = MultiTierStore(100 * size, disk_path=str(tmp_path), disk_bytes=100 * size, deferred_bytes=2 * size, seal=SEAL)
    s.put(*recs[0])
    assert s.disk is not None and s.disk.contains([recs[0][0]]) == [False]   # deferred, not yet written
    s.put(*recs[1])                                                      # 2 records: a batch goes down
    s.flush()
    assert s.disk.contains([recs[0][0], recs[1][0]]) == [True, True]
    for k, r in recs[2:]:
        s.put(k, r)
    s.close()                                                            # acknowledged => on disk
    assert DiskTier(tmp_path, 100 * size, seal=SEAL).get([k for k, _ in recs]) == [r for _, r in recs]


def test_a_full_filesystem_below_the_cap_evicts_the_oldest_records_and_keeps_storing(tmp_path: Path):
    # disk_bytes (64 MiB) is far above what the filesystem holds (a real 1 MiB tmpfs): once
    # it is full, each write evicts the oldest records and is tried again, so the newest
    # chunks are on disk (byte-identical), no temp file is left behind, and the tier's
    # accounting matches the directory. Before, every write after the first ENOSPC failed.
    from tests.conftest import mount_small_fs

    with mount_small_fs(tmp_path / "small", "1m") as root:
        tier = DiskTier(root, 64 << 20, seal=SEAL)
        recs = [record(i, 64 << 10) for i in range(40)]          # 2.5 MiB in all
        assert sum(tier.put([r]) for r in recs) == 40
        files = {p.name: p.stat().st_size for p in root.iterdir()}
        assert not [n for n in files if n.endswith(".tmp")], files
        assert tier.used == sum(files.values()) and 8 <= len(files) < 16, files
        got = tier.get([k for k, _ in recs])
        kept = [i for i, g in enumerate(got) if g is not None]
        assert kept == list(range(40 - len(kept), 40))          # the newest, in one run
        assert all(got[i] == recs[i][1] for i in kept)
        assert tier.failed_writes == 0


def test_corrupt_disk_file_is_a_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, 1 << 20, seal=SEAL)
    (k1, r1), (k2, r2) = record(1), record(2)
    assert disk.put([(k1, r1), (k2, r2)]) == 2
    f = tmp_path / f"{k2.hex()}.kvc"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    assert disk.get([k1, k2]) == [r1, None]
    assert disk.forged == 1 and disk.contains([k2]) == [False]      # a flipped bit fails the MAC first
    # a record stored under the wrong key is rejected too
    (tmp_path / f"{k1.hex()}.kvc").write_bytes(r2)
    assert disk.get([k1]) == [None]


def test_redis_roundtrip_corruption_and_outage(redis_url, caplog):
    url, proc = redis_url
    tier = RedisTier(url, seal=SEAL)
    (k1, r1), (k2, r2) = record(11, 70000), record(12, 70000)
    assert tier.put([(k1, r1), (k2, r2)]) == 2
    assert tier.get([k1, k2]) == [r1, r2]
    tier.client.setrange(tier._k(k2), len(r2) - 10, b"\x00" * 4)   # corrupt in place
    assert tier.get([k1, k2]) == [r1, None]
    assert tier.forged == 1                                          # the MAC catches it first
    # Store -> evicted from the CPU tier -> loaded back from Redis, byte-identical.
    recs = [record(100 + i) for i in range(4)]
    size = len(recs[0][1])
    sr = MultiTierStore(2 * size, redis_url=url, deferred_bytes=100 * size, seal=SEAL)
    for k, r in recs:
        sr.put(k, r)
        sr.flush()                       # written down before the next put evicts it from CPU
    assert sr.cpu.contains([recs[0][0]]) == [False] and sr.lookup_prefix([k for k, _ in recs]) == 4
    loaded = []
    for _k, view in sr.load([k for k, _ in recs]):
        assert view is not None
        loaded.append(bytes(view))
    assert loaded == [r for _, r in recs] and sr.stats.hits.get("redis", 0) >= 2
    # Redis-backed store: a killed server degrades to misses with a warning, never an exception.
    s = MultiTierStore(1 << 20, redis_url=url, deferred_bytes=1, seal=SEAL)
    k3, r3 = record(13)
    s.put(k3, r3)
    s.flush()
    assert RedisTier(url, seal=SEAL).get([k3]) == [r3]
    proc.kill()
    proc.wait()
    s2 = MultiTierStore(1 << 20, redis_url=url, seal=SEAL)
    with caplog.at_level("WARNING", logger="kvrelay.store"):
        assert s2.lookup_prefix([k3]) == 0
        assert list(s2.load([k3]))[0][1] is None
        s2.put(*record(14))
        s2.flush()
    assert "redis tier unavailable" in caplog.text


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed (deploy/setup.sh installs it)")
def test_an_unreachable_redis_is_skipped_for_retry_s_then_used_again(tmp_path, caplog):
    now = [100.0]
    port = free_port()                                   # nothing listens here yet
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", seal=SEAL, retry_s=5.0, clock=lambda: now[0])
    (k1, r1) = record(21)
    with caplog.at_level("WARNING", logger="kvrelay.store"):
        assert tier.contains([k1]) == [False]
    assert tier.errors == 1 and "redis tier unavailable during lookup" in caplog.text
    with redis_server(tmp_path, port=port) as (url, _):
        # Within retry_s the tier answers misses without trying the (now live) server.
        assert tier.contains([k1]) == [False] and tier.get([k1]) == [None] and tier.put([(k1, r1)]) == 0
        assert tier.errors == 1 and tier.skipped == 3
        assert RedisTier(url, seal=SEAL).get([k1]) == [None]        # the skipped put really wrote nothing
        now[0] += 5.0
        assert tier.put([(k1, r1)]) == 1 and tier.get([k1]) == [r1] and tier.contains([k1]) == [True]
        assert tier.errors == 1 and tier.skipped == 3


@pytest.mark.parametrize("policy,expected", [("lru", b"C"), ("lfu", b"B"), ("fifo", b"A")])
def test_policies_pick_different_victims(policy, expected):
    p = make_policy(policy)
    for k in (b"A", b"B", b"C"):
        p.insert(k)
    for k in (b"C", b"C", b"C", b"A", b"B", b"A"):
        p.access(k)
    # inserted A < B < C; last used C < B < A; uses A=3, B=2, C=4 (insert counts as one)
    assert p.victim(lambda k: True) == expected
    assert p.victim(lambda k: k != expected) != expected


def test_referenced_chunk_is_never_evicted():
    evicted = []
    cpu = CpuTier(2 * 4224 + 100, "lru", on_evict=lambda k, r: evicted.append(k))
    (k1, r1), (k2, r2), (k3, r3) = record(1), record(2), record(3)
    cpu.put(k1, r1)
    cpu.put(k2, r2)
    view = cpu.acquire(k1)                    # k1 is oldest but referenced
    assert cpu.put(k3, r3)
    assert evicted == [k2]
    assert cpu.put(*record(4)) is False or evicted[-1] != k1
    assert k1 not in evicted
    assert view is not None and bytes(view) == r1
    view.release()
    cpu.release(k1)


def test_the_cpu_tier_keeps_a_handed_over_record_without_copying_it():
    """records.build_record hands a bytearray over (one buffer for gather, store and push): the
    CPU tier serves that very buffer, and a bytes record as it is too."""
    from kvrelay.store.records import build_record, check_record

    key = (7).to_bytes(4, "big") * (KEY_BYTES // 4)
    payload = os.urandom(4096)

    def fill(dst: memoryview) -> None:
        dst[:] = payload

    rec = build_record(key, 0, len(payload), fill, num_layers=1, num_blocks=1)
    assert isinstance(rec, bytearray) and check_record(key, rec)
    tier = CpuTier(1 << 20)
    assert tier.put(key, rec)
    view = tier.acquire(key)
    assert view is not None and view.obj is rec and bytes(view[-4096:]) == payload
    tier.release(key)
