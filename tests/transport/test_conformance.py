"""One conformance suite, parametrized over every data-plane backend.

Sender and receiver run in separate processes. Payload integrity is checked by
sha256 of the source bytes (computed in the sender process) against sha256 of
the bytes in the receiver's slot - never by the backend's own checksum.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from kvrelay.bench.peer import RemoteError
from kvrelay.common.errors import ChecksumError, TransferTimeout
from kvrelay.common.wire import HEADER_SIZE, check_payload
from kvrelay.transport.events import ChunkArrival, ChunkRejected, FailReason, TransferDone, TransferFailed
from tests.transport.conftest import SLOT, assert_no_leases, keys_for, make_cfg, open_pair, payload_bytes


def drain(receiver, tid, timeout=10.0):
    """Collect events until the transfer ends; verify and release every arrival."""
    out = []
    while True:
        ev = receiver.next_event(tid, timeout)
        if isinstance(ev, ChunkArrival):
            out.append((ev, hashlib.sha256(payload_bytes(receiver, ev)).hexdigest()))
            receiver.release(ev)
        else:
            out.append((ev, None))
        if isinstance(ev, TransferDone | TransferFailed):
            receiver.finish(tid)
            return out


def drain_unreleased(receiver, tid, timeout=10.0):
    """The arrivals of ``tid`` until it ends, not released (the caller checks, then releases)."""
    out = []
    while not isinstance(ev := receiver.next_event(tid, timeout), TransferDone | TransferFailed):
        out.append((ev, None))
    return out


def wait_resolved(receiver, tid, timeout=10.0):
    """Wait until every chunk of ``tid`` has arrived or failed; True: all of them intact (landed)."""
    deadline = time.monotonic() + timeout
    while not (t := receiver.table.transfers.get(tid)) or not t.done:
        assert time.monotonic() < deadline, f"{tid} never resolved"
        time.sleep(0.01)
    return tid in receiver.landed()


SIZES = [1, 4093, 65536, 300_001, 1 << 20]


def test_random_payloads_arrive_byte_identical(pair):
    receiver, peer = pair
    tid = "intact"
    peer.call("prepare", "src", sum(SIZES), 1234)
    offs = [sum(SIZES[:i]) for i in range(len(SIZES))]
    peer.call("alloc", tid, keys_for(tid, len(SIZES)), [HEADER_SIZE + n for n in SIZES])
    want = {}
    for i, (off, n) in enumerate(zip(offs, SIZES, strict=True)):
        want[i] = peer.call("digest", "src", off, n)
        peer.call("write", tid, i, "src", off, n, 1 + i % 3)       # 1..3 regions per chunk
    assert wait_resolved(receiver, tid)                          # wholly here: its consumer may install it now
    events = drain(receiver, tid)
    assert tid not in receiver.landed()                          # ... until it finished it
    got = {ev.chunk_index: d for ev, d in events if isinstance(ev, ChunkArrival)}
    assert got == want
    assert isinstance(events[-1][0], TransferDone) and events[-1][0].arrived == len(SIZES)
    assert receiver.stats.checksum_failures == 0


def test_named_blocks_of_a_registered_layout_arrive_byte_identical(pair):
    """Chunks named as blocks of a registered KV layout (prepared descriptor lists on nixl;
    plain buffers where a backend has no such capability) land intact, chunk after chunk,
    so reposting the prepared lists into reused slots is covered too."""
    receiver, peer = pair
    block, n = 16384, 6
    peer.call("prepare", "kv", n * 2 * block, 99, block)       # 2 blocks per chunk
    for rnd in range(2):
        tid = f"blocks{rnd}"
        peer.call("alloc", tid, keys_for(tid, n), [HEADER_SIZE + 2 * block] * n)
        want = {}
        for i in range(n):
            c = (i + rnd) % n                                   # a different block pair per round
            want[i] = peer.call("digest", "kv", c * 2 * block, 2 * block)
            peer.call("write", tid, i, "kv", c * 2 * block, 2 * block, 1, False, True, True)
        events = drain(receiver, tid)
        assert {ev.chunk_index: d for ev, d in events if isinstance(ev, ChunkArrival)} == want
    assert receiver.stats.checksum_failures == 0
    assert_no_leases(receiver)


def test_arrivals_fire_in_completion_order_while_last_chunk_is_held_back(pair):
    receiver, peer = pair
    tid = "pipelined"
    n, size = 5, 256 * 1024
    peer.call("prepare", "src", n * size, 7)
    peer.call("alloc", tid, keys_for(tid, n), [HEADER_SIZE + size] * n)
    order = [2, 0, 3, 1]                                    # the last chunk (4) is held back
    for i in order:
        peer.call("write", tid, i, "src", i * size, size)
    seen = []
    for _ in order:
        ev = receiver.next_event(tid, 10)
        assert isinstance(ev, ChunkArrival), ev
        seen.append(ev.chunk_index)
        receiver.release(ev)
    assert seen == order
    with pytest.raises(TransferTimeout):                    # nothing more until chunk 4 is sent
        receiver.next_event(tid, 0.3)
    peer.call("write", tid, 4, "src", 4 * size, size)
    events = drain(receiver, tid)
    assert [e.chunk_index for e, _ in events if isinstance(e, ChunkArrival)] == [4]
    assert isinstance(events[-1][0], TransferDone)


def test_corrupted_payload_is_rejected_by_checksum(pair):
    receiver, peer = pair
    tid = "corrupt"
    peer.call("prepare", "src", 3 * 65536, 9)
    peer.call("alloc", tid, keys_for(tid, 3), [HEADER_SIZE + 65536] * 3)
    peer.call("write", tid, 0, "src", 0, 65536)
    peer.call("write", tid, 1, "src", 65536, 65536, 1, True)          # corrupted in flight
    peer.call("write", tid, 2, "src", 2 * 65536, 65536)
    if receiver.pool.on_device:                                  # the consumer hashes what it installs
        assert wait_resolved(receiver, tid)
        arrived = {e.chunk_index: e for e, _ in drain_unreleased(receiver, tid)}
        assert not arrived[1].verified
        with pytest.raises(ChecksumError):
            check_payload(arrived[1].header, payload_bytes(receiver, arrived[1]))
        for e in arrived.values():
            receiver.release(e)
        receiver.finish(tid)
        return
    assert not wait_resolved(receiver, tid)                      # a rejected chunk: never "landed"
    events = drain(receiver, tid)
    rejected = [e for e, _ in events if isinstance(e, ChunkRejected)]
    assert [(e.chunk_index, e.reason) for e in rejected] == [(1, FailReason.CHECKSUM)]
    assert sorted(e.chunk_index for e, _ in events if isinstance(e, ChunkArrival)) == [0, 2]
    assert receiver.stats.checksum_failures == 1


def test_abort_frees_slots(pair):
    receiver, peer = pair
    tid = "aborted"
    peer.call("prepare", "src", 65536, 3)
    peer.call("alloc", tid, keys_for(tid, 4), [HEADER_SIZE + 65536] * 4)
    peer.call("write", tid, 0, "src", 0, 65536)
    assert receiver.pool.stats().leased >= 3
    peer.call("abort", tid, "client went away")
    events = drain(receiver, tid)
    assert isinstance(events[-1][0], TransferFailed)
    assert events[-1][0].reason is FailReason.ABORTED
    assert "client went away" in events[-1][0].detail


def test_expired_lease_frees_slots(backend):
    with open_pair(make_cfg(backend, **{"timeouts.lease_s": 0.4, "timeouts.chunk_s": 0.4})) as (receiver, peer):
        peer.call("alloc", "lease", keys_for("lease", 2), [HEADER_SIZE + 4096] * 2)
        t0 = time.monotonic()
        events = drain(receiver, "lease")                      # nothing is ever written
        assert time.monotonic() - t0 < 5
        assert [e.reason for e, _ in events if isinstance(e, ChunkRejected)] == [FailReason.LEASE_EXPIRED] * 2
        assert receiver.pool.stats().leases_expired == 2
        assert_no_leases(receiver)


def test_sender_death_mid_transfer_is_detected(backend):
    cfg = make_cfg(backend, **{"timeouts.peer_s": 1.0})
    with open_pair(cfg) as (receiver, peer):
        peer.call("prepare", "src", 65536, 5)
        peer.call("alloc", "dies", keys_for("dies", 4), [HEADER_SIZE + 65536] * 4)
        peer.call("write", "dies", 0, "src", 0, 65536)
        t0 = time.monotonic()
        peer.kill()
        events = drain(receiver, "dies", timeout=5)
        elapsed = time.monotonic() - t0
        assert isinstance(events[-1][0], TransferFailed), events
        assert events[-1][0].reason is FailReason.PEER_DEAD
        assert elapsed <= cfg.timeouts.peer_s + 1.0, elapsed          # within the timeout (+ poll slack)
        assert receiver.stats.peers_dead >= 1
        assert_no_leases(receiver)


def test_full_pool_applies_backpressure_then_refuses(backend):
    cfg = make_cfg(backend, **{"transport.pool_bytes": 4 * SLOT + 4096 * 4})
    with open_pair(cfg) as (receiver, peer):
        assert receiver.pool.num_slots == 4
        peer.call("prepare", "src", 4096, 1)
        peer.call("alloc", "fill", keys_for("fill", 4), [HEADER_SIZE + 4096] * 4)
        # 1) refused: nobody frees a slot within the wait
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            peer.call("alloc", "starved", keys_for("starved", 1), [HEADER_SIZE + 4096], 0.5)
        assert err.value.kind == "PoolFullError" and "pool full" in str(err.value)
        assert time.monotonic() - t0 >= 0.5
        assert receiver.stats.alloc_refused == 1
        # 2) back-pressure: the alloc waits and succeeds once a transfer frees its slots
        threading.Timer(0.4, lambda: receiver.abort("fill", "consumer gave up")).start()
        t0 = time.monotonic()
        got = peer.call("alloc", "waits", keys_for("waits", 2), [HEADER_SIZE + 4096] * 2, 3.0)
        assert got["grants"] == [0, 1] and time.monotonic() - t0 >= 0.35
        for i in range(2):
            peer.call("write", "waits", i, "src", 0, 4096)
        events = drain(receiver, "waits")
        assert isinstance(events[-1][0], TransferDone) and events[-1][0].arrived == 2
        drain(receiver, "fill")
        assert_no_leases(receiver)


def test_a_parked_alloc_given_up_on_leaves_the_queue_at_once_and_never_takes_a_slot():
    """A push that gives up on an Alloc D parks (pool full) sends an Abort at once: D drops the
    parked Alloc (its consumer sees TransferFailed ABORTED) instead of granting it slots when
    they free up - slots nobody would write and, with no further reply read by that sender,
    nobody would give back before the lease (``timeouts.lease_s``) runs out."""
    cfg = make_cfg("tcp", **{"transport.pool_bytes": 4 * SLOT + 4096 * 4})
    with open_pair(cfg) as (receiver, peer):
        peer.call("prepare", "src", 4096, 1)
        peer.call("alloc", "fill", keys_for("fill", 4), [HEADER_SIZE + 4096] * 4)
        receiver.expect("gave-up")
        answered = peer.call("give_up_alloc", "gave-up", keys_for("gave-up", 4), [HEADER_SIZE + 4096] * 4, 20.0)
        assert not answered
        events = drain(receiver, "gave-up", timeout=2.0)          # not the Alloc's 20 s
        assert isinstance(events[-1][0], TransferFailed) and events[-1][0].reason is FailReason.ABORTED, events
        assert receiver.tracked()["pending"] == 0 and receiver.stats.aborts == 1
        receiver.finish("gave-up")
        receiver.abort("fill", "consumer gave up")                 # the slots free up: nobody takes them
        time.sleep(0.3)
        st = receiver.pool.stats()
        assert st.free == st.slots, st
        # a grant that crosses the Abort: D grants, then frees the slots when the Abort comes
        drain(receiver, "fill")
        assert peer.call("give_up_alloc", "crossed", keys_for("crossed", 2), [HEADER_SIZE + 4096] * 2, 5.0) in (True, False)
        deadline = time.monotonic() + 2
        while receiver.pool.stats().free != receiver.pool.stats().slots and time.monotonic() < deadline:
            time.sleep(0.02)
        receiver.finish("crossed")
        assert receiver.stats.foreign_aborts == 0 and receiver.stats.refusals["foreign"] == 0
        assert_no_leases(receiver)


def test_alloc_skips_keys_the_receiver_holds(backend):
    keys = keys_for("skip", 4)
    with open_pair(make_cfg(backend)) as (receiver, peer):
        receiver.expect("skip", held=keys[:2])
        receiver.expect("other")             # same keys, but this transfer holds nothing
        peer.call("prepare", "src", 4096, 2)
        got = peer.call("alloc", "skip", keys, [HEADER_SIZE + 4096] * 4)
        assert got == {"grants": [2, 3], "held": [0, 1]}
        other = peer.call("alloc", "other", keys, [HEADER_SIZE + 4096] * 4)
        assert other == {"grants": [0, 1, 2, 3], "held": []}, "held must be per transfer"
        peer.call("abort", "other")
        receiver.finish("other")
        for i in (2, 3):
            peer.call("write", "skip", i, "src", 0, 4096)
        events = drain(receiver, "skip")
        assert events[-1][0] == TransferDone("skip", 2, 0, (0, 1))
        assert_no_leases(receiver)


@pytest.mark.parametrize("what", ["fingerprint", "secret"])
def test_incompatible_or_unauthenticated_hello_is_refused(what):
    cfg = make_cfg("tcp")
    kw = ({"sender_fp": hashlib.sha256(b"other model").digest()} if what == "fingerprint"
          else {"sender_secret": b"wrong-but-long-enough-secret"})
    with open_pair(cfg, connect=False, **kw) as (_receiver, peer):
        with pytest.raises(RemoteError) as err:
            peer.call("connect")
        assert err.value.kind == "HandshakeError"
        assert ("fingerprint" if what == "fingerprint" else "HMAC") in str(err.value)


def test_a_stopping_receiver_refuses_new_transfers_and_keeps_the_ones_it_granted(backend):
    """Graceful drain: once the node is stopping (the ``closing`` hook answers why), an Alloc is
    refused at once - no write may be in flight when the process exits - while a transfer
    granted before goes on to deliver."""
    stopping = [""]
    with open_pair(make_cfg(backend), closing=lambda: stopping[0]) as (receiver, peer):
        peer.call("prepare", "src", 4096, 1)
        peer.call("alloc", "before", keys_for("before", 1), [HEADER_SIZE + 4096])
        stopping[0] = "the decode node is stopping"
        with pytest.raises(RemoteError) as err:
            peer.call("alloc", "after", keys_for("after", 1), [HEADER_SIZE + 4096], 5.0)
        assert err.value.kind == "PoolFullError" and "stopping" in str(err.value)
        assert receiver.stats.alloc_refused == 1
        receiver.abort("before", "test over")
        assert_no_leases(receiver)


def test_a_granted_transfer_that_waits_costs_little_cpu(backend):
    """An early Alloc is granted while P is still computing (or queued behind other prompts):
    D's receiver then watches slots nothing arrives in, for as long as the prefill takes. That
    watch must not busy-poll - on a 2-core host it competes with both engines (the nixl and
    ucx pollers once cost ~23 % of a core here). Judged on the quietest of three 1 s windows."""
    with open_pair(make_cfg(backend)) as (receiver, peer):
        receiver.expect("idle")
        peer.call("alloc", "idle", keys_for("idle", 4), [HEADER_SIZE + 4096] * 4)
        time.sleep(0.2)
        shares = []
        for _ in range(3):
            c0, t0 = time.process_time(), time.monotonic()
            time.sleep(1.0)
            shares.append((time.process_time() - c0) / (time.monotonic() - t0))
        assert min(shares) < 0.10, f"the receiver process used {min(shares):.0%} of a core with nothing arriving"
        peer.call("abort", "idle")
        drain(receiver, "idle")


def test_nixl_in_peer_error_mode_delivers_intact_and_detects_a_dead_sender():
    """``transport.nixl_error_mode: peer`` (UCX's error handling on, NIXL's default): writes go
    over another UCX lane than in mode ``none`` (FACTS.md), so check delivery and a sender's
    death in that mode too, with the same mode on both sides as the option requires."""
    cfg = make_cfg("nixl", **{"transport.nixl_error_mode": "peer", "timeouts.peer_s": 1.0})
    with open_pair(cfg) as (receiver, peer):
        assert receiver.backend.error_mode == "peer"
        peer.call("prepare", "src", sum(SIZES), 99)
        offs = [sum(SIZES[:i]) for i in range(len(SIZES))]
        peer.call("alloc", "peer-mode", keys_for("peer-mode", len(SIZES)), [HEADER_SIZE + n for n in SIZES])
        want = {i: peer.call("digest", "src", off, n) for i, (off, n) in enumerate(zip(offs, SIZES, strict=True))}
        for i, (off, n) in enumerate(zip(offs, SIZES, strict=True)):
            peer.call("write", "peer-mode", i, "src", off, n)
        events = drain(receiver, "peer-mode")
        assert {ev.chunk_index: d for ev, d in events if isinstance(ev, ChunkArrival)} == want
        assert isinstance(events[-1][0], TransferDone)
        peer.call("alloc", "dies", keys_for("dies", 4), [HEADER_SIZE + 65536] * 4)
        peer.call("write", "dies", 0, "src", 0, 65536)
        peer.kill()
        events = drain(receiver, "dies", timeout=5)
        assert isinstance(events[-1][0], TransferFailed) and events[-1][0].reason is FailReason.PEER_DEAD
        assert_no_leases(receiver)
