"""A transfer that dies before it is granted wakes its consumer at once (a tombstone).

Before: a decode request aborted before P's Alloc arrived, or an early push dropped as an
orphan before D's consumer registered, left the consumer waiting ``first_chunk_s`` (30 s)
- holding its KV blocks and an install thread while the loads behind it expired.
"""

from __future__ import annotations

import time

import pytest

from kvrelay.common.errors import PoolFullError
from kvrelay.transport.backends import make_sender_backend
from kvrelay.transport.events import FailReason, TransferDone, TransferFailed
from kvrelay.transport.ledger import Tombstones
from kvrelay.transport.sender import Sender
from tests.transport.conftest import FP, assert_no_leases, keys_for, make_cfg, make_receiver


@pytest.fixture
def node():
    cfg = make_cfg("tcp", **{"timeouts.chunk_s": 0.3, "timeouts.lease_s": 0.5})
    receiver = make_receiver(cfg, slot_bytes=8192, consumer_wait_s=2.0)
    sender = Sender(cfg.transport, cfg.timeouts, receiver.endpoint, make_sender_backend(cfg.transport), FP)
    sender.connect()
    yield receiver, sender
    sender.close()
    receiver.close()
    assert_no_leases(receiver)


def test_an_abort_before_the_grant_wakes_the_consumer_and_refuses_the_alloc(node):
    receiver, sender = node
    receiver.expect("t-abort")
    receiver.abort("t-abort", "request aborted on the decode node")
    t0 = time.monotonic()
    ev = receiver.next_event("t-abort", 30)
    assert isinstance(ev, TransferFailed) and ev.reason is FailReason.ABORTED
    assert time.monotonic() - t0 < 1.0                       # not the 30 s deadline
    receiver.finish("t-abort")
    with pytest.raises(PoolFullError, match="aborted"):      # P's Alloc, arriving late, is refused
        sender.alloc("t-abort", keys_for("t-abort", 2), [4096, 4096], early=True)


def test_an_abort_refuses_an_alloc_parked_for_its_consumer(node):
    receiver, sender = node
    pending = sender.alloc_async("t-parked", keys_for("t-parked", 1), [4096], wait_s=5)   # parks: no consumer yet
    time.sleep(0.1)
    receiver.abort("t-parked")
    deadline = time.monotonic() + 3
    with pytest.raises(PoolFullError, match="aborted"):
        while sender.poll_alloc(pending) is None:
            assert time.monotonic() < deadline
            sender.wait_replies(0.05)


def test_a_consumer_that_registers_after_its_orphan_was_dropped_learns_it_at_once(node):
    receiver, sender = node
    alloc = sender.alloc("t-orphan", keys_for("t-orphan", 1), [4096], early=True)   # granted, no consumer
    sender.wait(sender.write_chunk(alloc, 0, [bytearray(4096 - 128)]))
    deadline = time.monotonic() + 5
    while receiver.stats.orphans_dropped == 0:               # lease_s after it ended, it is dropped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    receiver.expect("t-orphan")                               # D's request got scheduled only now
    t0 = time.monotonic()
    ev = receiver.next_event("t-orphan", 30)
    assert isinstance(ev, TransferFailed) and "no consumer" in ev.detail
    assert time.monotonic() - t0 < 1.0
    receiver.finish("t-orphan")
    assert not isinstance(ev, TransferDone)


def test_tombstones_are_bounded():
    t = Tombstones(capacity=3)
    for i in range(5):
        t.bury(f"t{i}", "x")
    assert len(t) == 3 and t.why("t0") is None and t.why("t4") == "x"
