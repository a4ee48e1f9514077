"""Hardening of the receive side, over every backend.

Failure mode 7: the consumer finishing a transfer while the data plane delivers one of
its chunks must not kill a backend thread or the control plane.

The interleaving is forced deterministically: the test's ``verify_chunk`` wrapper calls
``finish()`` from another thread after the receiver looked the transfer up and before
it publishes the arrival - exactly the window the race hits under load. Afterwards a
fresh transfer over the same connection must complete with nothing leaked.
"""

from __future__ import annotations

import contextlib
import threading
import time

import transport.receiver as rx
from tests.transport.conftest import assert_no_leases, keys_for, make_cfg, open_pair
from tests.transport.test_conformance import drain
from transport.errors import TransferTimeout
from transport.events import TransferDone
from transport.wire import HEADER_SIZE


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
