"""An error about one transfer is answered for that transfer and never ends the session.

Before: the receiver answered a bad Alloc (an id over 256 characters, a transfer already
active) with a session ``Error``, the Sender kept it forever and every later push on that
lane failed at once - each later request waited out ``first_chunk_s`` and recomputed.
"""

from __future__ import annotations

import pytest

from kvrelay.common.errors import ErrorCode, PoolFullError, ProtocolError
from kvrelay.prefill.lanes import session_lost
from kvrelay.transport.backends import make_sender_backend
from kvrelay.transport.sender import Sender
from tests.transport.conftest import FP, assert_no_leases, keys_for, make_cfg, make_receiver


def test_a_bad_alloc_is_refused_per_transfer_and_the_session_goes_on():
    cfg = make_cfg("tcp")
    receiver = make_receiver(cfg)
    sender = Sender(cfg.transport, cfg.timeouts, receiver.endpoint, make_sender_backend(cfg.transport), FP)
    try:
        sender.connect()
        with pytest.raises(PoolFullError, match="1..256 characters"):
            sender.alloc("x" * 300, keys_for("long", 1), [4096], early=True)
        first = sender.alloc("t-1", keys_for("t-1", 1), [4096], early=True)
        assert first.grants
        with pytest.raises(PoolFullError, match="already active"):       # the same sender, the same id
            sender.alloc("t-1", keys_for("t-1", 1), [4096], early=True)
        second = sender.alloc("t-2", keys_for("t-2", 2), [4096, 4096], early=True)
        assert len(second.grants) == 2                                   # the session is still good
        assert receiver.stats.refusals["bad_alloc"] == 2
        for tid in ("t-1", "t-2"):
            sender.abort(tid)
            receiver.finish(tid)
    finally:
        sender.close()
        receiver.close()
    assert_no_leases(receiver)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_any_session_error_replaces_the_sender(code):
    assert session_lost(ProtocolError("x", code))
    assert not session_lost(PoolFullError("refused"))
