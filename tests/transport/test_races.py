"""Hardening of the receive side, over every backend (and the pool's fencing).

Failure mode 7: the consumer finishing a transfer while the data plane delivers one of
its chunks must not kill a backend thread or the control plane.

The interleaving is forced deterministically: the test's ``verify_chunk`` wrapper calls
``finish()`` from another thread after the receiver looked the transfer up and before
it publishes the arrival - exactly the window the race hits under load. Afterwards a
fresh transfer over the same connection must complete with nothing leaked.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time

import pytest

import kvrelay.transport.landing as rx
from kvrelay.common.errors import TransferTimeout
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.transport.events import Refusal, TransferDone
from tests.transport.conftest import assert_no_leases, keys_for, make_cfg, open_pair
from tests.transport.test_conformance import drain


def test_finish_racing_a_delivery_leaves_the_receiver_working(pair, monkeypatch):
    receiver, peer = pair
    real = rx.verify_chunk
    fired = threading.Event()

    def verify_then_finish(*args, **kwargs):
        hdr = real(*args, **kwargs)
        if not fired.is_set():
            fired.set()
            t = threading.Thread(target=receiver.finish, args=("race",))
            t.start()
            t.join(5)
        return hdr

    monkeypatch.setattr(rx, "verify_chunk", verify_then_finish)
    peer.call("prepare", "src", 4 * 4096, 11)
    peer.call("alloc", "race", keys_for("race", 2), [HEADER_SIZE + 4096] * 2)
    peer.call("write", "race", 0, "src", 0, 4096)
    deadline = time.monotonic() + 10
    while not fired.is_set() and time.monotonic() < deadline:
        with contextlib.suppress(TransferTimeout):      # poll-driven backends deliver from here
            receiver.next_event("race", 0.2)
    assert fired.is_set(), "the chunk was never delivered"
    receiver.finish("race")
    peer.call("abort", "race")

    peer.call("alloc", "after", keys_for("after", 2), [HEADER_SIZE + 4096] * 2)
    for i in range(2):
        peer.call("write", "after", i, "src", i * 4096, 4096)
    events = drain(receiver, "after")
    assert isinstance(events[-1][0], TransferDone) and events[-1][0].arrived == 2, events
    assert receiver.stats.internal_errors == 0
    assert_no_leases(receiver)


def test_transfers_no_consumer_registers_are_dropped_with_their_slots(backend):
    """Failure mode 4: D rejected the request (or never scheduled it), so nobody consumes the
    transfer P allocated. Its slots and every per-transfer entry go away after lease_s."""
    cfg = make_cfg(backend, **{"timeouts.lease_s": 0.5, "timeouts.chunk_s": 0.5})
    with open_pair(cfg, consumer_wait_s=0.05) as (receiver, peer):
        peer.call("prepare", "src", 4096, 3)
        for i in range(5):
            tid = f"orphan{i}"
            peer.call("alloc", tid, keys_for(tid, 2), [HEADER_SIZE + 4096] * 2)
            peer.call("write", tid, 0, "src", 0, 4096)          # chunk 1 never comes
        deadline = time.monotonic() + 10
        while any(receiver.tracked().values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(receiver.tracked().values()), receiver.tracked()
        assert receiver.stats.orphans_dropped == 5
        assert_no_leases(receiver)


def test_late_writes_find_no_reused_slot_fifo_and_quarantine():
    """Failure mode 6: a slot freed before it was filled (abort, failure, expiry: a write may
    still be in flight) is not leased again for quarantine_s, and reuse is FIFO."""
    from kvrelay.transport.pool import ReceivePool

    now = [100.0]
    pool = ReceivePool(4 * 8192, 8000, lease_s=5, clock=lambda: now[0], pin=False, quarantine_s=0.5)
    try:
        a = pool.try_allocate(2, "aborted")
        assert a is not None
        assert pool.release_owner("aborted") == 2                # never filled: quarantined
        b = pool.try_allocate(2, "next")
        assert b is not None and {r.index for r in b}.isdisjoint({r.index for r in a})
        assert pool.try_allocate(1, "more") is None               # the aborted slots are not reusable yet
        assert pool.stats().quarantined == 2
        now[0] += 0.6
        c = pool.try_allocate(2, "later")
        assert c is not None and {r.index for r in c} == {r.index for r in a}
        for ref in b:                                             # filled and consumed: free at once, FIFO
            pool.mark_filled(ref)
            pool.take(ref)
            pool.release(ref)
        pool.release_owner("later")
        d = pool.try_allocate(2, "fifo")
        assert d is not None and [r.index for r in d] == [r.index for r in b]   # longest-free first
    finally:
        pool.close()


def test_consumer_verified_payload_catches_a_write_after_arrival(backend):
    """Failure mode 6: with verify_payload=False (the decode installer) a chunk whose bytes
    change after arrival - a stale writer landing late - is caught by the consumer's check of
    the exact bytes it installs. Backends that hash as bytes land (tcp) verify on arrival."""
    from kvrelay.common.errors import ChecksumError
    from kvrelay.common.wire import check_payload

    with open_pair(make_cfg(backend), verify_payload=False) as (receiver, peer):
        peer.call("prepare", "src", 8192, 21)
        peer.call("alloc", "late", keys_for("late", 1), [HEADER_SIZE + 8192])
        peer.call("write", "late", 0, "src", 0, 8192)
        ev = receiver.next_event("late", 10)
        payload = receiver.payload(ev)
        if ev.verified:
            assert backend == "tcp"                                # hashed piecewise as it landed
        else:
            check_payload(ev.header, bytes(payload))              # intact as it arrived
        payload[100] ^= 0xFF                                       # the late write
        with pytest.raises(ChecksumError):
            check_payload(ev.header, bytes(payload))
        receiver.release(ev)
        drain(receiver, "late")
        assert_no_leases(receiver)


def test_a_second_sender_takes_over_a_live_transfer(backend):
    """Failure mode 4 (the router's prefill retry reuses the transfer id): after P1 delivered
    chunk 0 and died, P2 allocates the same transfer. It is granted what is still missing,
    what P1 delivered counts as held, and the consumer sees one transfer end to end."""
    from kvrelay.bench.peer import SenderPeer
    from tests.transport.conftest import FP

    keys = keys_for("retry", 3)
    with open_pair(make_cfg(backend)) as (receiver, p1), SenderPeer(make_cfg(backend), receiver.endpoint, FP) as p2:
        receiver.expect("retry")
        p2.call("connect")
        for peer in (p1, p2):
            peer.call("prepare", "src", 3 * 4096, 17)                 # same prompt, same bytes
        p1.call("alloc", "retry", keys, [HEADER_SIZE + 4096] * 3)
        p1.call("write", "retry", 0, "src", 0, 4096)
        first = receiver.next_event("retry", 10)
        assert first.chunk_index == 0
        receiver.release(first)
        got = p2.call("alloc", "retry", keys, [HEADER_SIZE + 4096] * 3)
        assert got == {"grants": [1, 2], "held": [0]}
        p1.call("abort", "retry")                         # the old sender gives up: not its transfer any more
        for i in (1, 2):
            p2.call("write", "retry", i, "src", i * 4096, 4096)
        events = drain(receiver, "retry")
        arrived = sorted(ev.chunk_index for ev, _ in events if not isinstance(ev, TransferDone))
        assert arrived == [1, 2] and events[-1][0] == TransferDone("retry", 2, 0, (0,))
        assert receiver.stats.takeovers == 1
        # P1's Abort and P2's writes travel on different sockets: D sees the Abort either while
        # P2's transfer is live (foreign) or after it ended (stale) - ignored either way
        def ignored() -> int:
            return receiver.stats.foreign_aborts + receiver.stats.refusals[Refusal.STALE.value]
        deadline = time.monotonic() + 5
        while ignored() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ignored() == 1 and receiver.stats.aborts == 0
        assert_no_leases(receiver)


LANES, PUSHES, CHUNKS, BLOCK = 2, 40, 4, 16384


def _lanes_child(backend: str, endpoints: list[str], out) -> None:
    """The prefill side as the pusher runs it: one process, one Sender per decode node, each
    driven from its own lane thread at the same time (one shared NIXL agent underneath)."""
    import numpy as np

    from kvrelay.common.wire import make_header
    from kvrelay.transport.backends import make_sender_backend
    from kvrelay.transport.backends.base import BlockPayload, MemRegion, SourceLayout
    from kvrelay.transport.sender import Sender
    from tests.transport.conftest import FP

    cfg = make_cfg(backend)
    src = np.random.default_rng(5).integers(0, 256, CHUNKS * 2 * BLOCK, dtype=np.uint8)
    out.put(("source", hashlib.sha256(src).hexdigest()))

    def lane(k: int, endpoint: str) -> None:
        try:
            push_all(k, endpoint)
        except Exception as exc:
            out.put(("error", f"lane {k}: {type(exc).__name__}: {exc}"))
            raise

    def push_all(k: int, endpoint: str) -> None:
        s = Sender(cfg.transport, cfg.timeouts, endpoint, make_sender_backend(cfg.transport), FP)
        s.connect()
        named = s.backend.capabilities.registered_layout
        if named:
            s.register_layout(SourceLayout((MemRegion(int(src.ctypes.data), src.nbytes),), BLOCK))
        out.put(("ready", k))
        for t in range(PUSHES):
            tid = f"lane{k}-{t}"
            a = s.alloc(tid, keys_for(tid, CHUNKS), [HEADER_SIZE + 2 * BLOCK] * CHUNKS)
            handles = []
            for i in range(CHUNKS):
                view = memoryview(src)[i * 2 * BLOCK:(i + 1) * 2 * BLOCK]
                payload = BlockPayload((2 * i, 2 * i + 1)) if named else [view]
                header = make_header(a.keys[i], tid, i, [view]).pack()
                handles.append(s.write_chunk(a, i, payload, header=header))
            for h in handles:
                if h is not None:
                    s.wait(h, timeout=10)
        # no close: the test kills this process (what a close costs is not what is tested here)

    threads = [threading.Thread(target=lane, args=(k, ep)) for k, ep in enumerate(endpoints)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _lanes_ready(out, timeout: float) -> str:
    """Wait until every lane of the child has connected; the source's digest. A lane that
    failed first is the assertion's message."""
    source, ready, deadline = None, set(), time.monotonic() + timeout
    while source is None or len(ready) < LANES:
        try:
            kind, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"lanes {sorted(ready)} of {LANES} connected after {timeout} s") from None
        assert kind != "error", value
        if kind == "source":
            source = value
        else:
            ready.add(value)
    return source


def _child_errors(out) -> list[str]:
    errors = []
    with contextlib.suppress(queue.Empty):
        while True:
            kind, value = out.get(timeout=1)
            errors += [value] if kind == "error" else []
    return errors


def test_senders_on_parallel_lane_threads_of_one_process_all_deliver(backend):
    """A prefill node pushes to several decode nodes at once, each from its own lane thread.
    Every chunk of every transfer must arrive byte-identical on both receivers. (Over nixl the
    process's one agent is called from both threads: with NIXL's default thread-sync mode
    (none), its writes stalled for good as soon as two lanes were busy.)"""
    import hashlib as _h
    import multiprocessing as mp

    from kvrelay.transport.events import ChunkArrival, TransferFailed
    from tests.transport.conftest import make_receiver

    cfg = make_cfg(backend)
    receivers = [make_receiver(cfg) for _ in range(LANES)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_lanes_child, args=(backend, [r.endpoint for r in receivers], out), daemon=True)
    digests: dict[str, str] = {}
    failed: list[str] = []

    def consume(k: int) -> None:
        r = receivers[k]
        for t in range(PUSHES):
            if failed:                                   # one stall is enough; don't wait out the rest
                return
            tid = f"lane{k}-{t}"
            parts = {}
            while True:
                try:
                    ev = r.next_event(tid, 15)
                except TransferTimeout as exc:
                    failed.append(f"{tid}: {exc}")
                    break
                if isinstance(ev, ChunkArrival):
                    parts[ev.chunk_index] = bytes(r.payload(ev))
                    r.release(ev)
                    continue
                if isinstance(ev, TransferFailed):
                    failed.append(f"{tid}: {ev}")
                break
            r.finish(tid)
            digests[tid] = _h.sha256(b"".join(parts[i] for i in sorted(parts))).hexdigest()

    try:
        child.start()
        source = _lanes_ready(out, 60)               # spawn + imports + connects: not in the timeouts below
        consumers = [threading.Thread(target=consume, args=(k,)) for k in range(LANES)]
        for c in consumers:
            c.start()
        for c in consumers:
            c.join(120)
        assert not any(c.is_alive() for c in consumers), "a consumer is still waiting after 120 s"
        assert not failed, failed[:5] + _child_errors(out)
        assert set(digests.values()) == {source}, f"{sum(d != source for d in digests.values())} transfers differ"
        for r in receivers:
            assert_no_leases(r)
    finally:
        child.kill()
        for r in receivers:
            r.close()
