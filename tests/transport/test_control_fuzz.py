"""Control-plane fuzzing: random and truncated frames never crash the receiver,
and each gets a clear ``Error`` reply."""

from __future__ import annotations

import os

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.transport import protocol as P
from tests.transport.conftest import FP, make_cfg, make_receiver

VALID = [
    P.Hello(sender_id="s", fingerprint=FP, backend="tcp", nonce=b"n" * 16, challenge=b"c" * 32, mac=b"m" * 32),
    P.Alloc(transfer_id="t", keys=[b"k" * 32] * 3, chunk_bytes=[4096] * 3, session=b"s" * 16, seq=1),
    P.Abort(transfer_id="t", reason="x"),
    P.Heartbeat(session=b"s" * 16, seq=1, mac=b"m" * 32),
]
CODES = {c.value for c in P.ErrorCode}


@pytest.fixture(scope="module")
def receiver():
    r = make_receiver(make_cfg("tcp", **{"transport.max_message_bytes": 4096}))
    yield r
    r.close()


@pytest.fixture(scope="module")
def dealer(receiver):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"fuzzer")
    s.setsockopt(zmq.LINGER, 0)
    s.connect(receiver.endpoint)
    yield s
    s.close()


def roundtrip(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(5000), "receiver did not answer (crashed or hung?)"
    reply = P.decode(sock.recv(), 1 << 20)
    assert isinstance(reply, P.Error | P.HelloAck | P.ChallengeAck), reply
    return reply


def assert_rejected(reply):
    if isinstance(reply, P.ChallengeAck):  # a well-formed Challenge is answered (it proves nothing)
        return
    if isinstance(reply, P.HelloAck):     # a structurally valid but unauthenticated Hello
        assert not reply.ok and reply.reason
        return
    assert reply.code in CODES and len(reply.reason) > 5


def assert_alive(sock, receiver):
    before = receiver.stats.messages
    reply = roundtrip(sock, [P.encode(P.Heartbeat(session=b"nobody", seq=1))])
    assert reply.code == P.ErrorCode.UNAUTHENTICATED.value
    assert receiver.stats.messages == before + 1


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@fuzz
@given(data=st.binary(max_size=600))
def test_random_frames_get_a_clear_rejection(receiver, dealer, data):
    assert_rejected(roundtrip(dealer, [data]))


@fuzz
@given(which=st.integers(0, len(VALID) - 1), cut=st.floats(0, 0.999))
def test_truncated_frames_get_a_clear_rejection(receiver, dealer, which, cut):
    raw = P.encode(VALID[which])
    reply = roundtrip(dealer, [raw[: int(len(raw) * cut)]])
    assert reply.code in {"malformed", "version"}


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8),
                    st.binary(max_size=40), st.floats(allow_nan=False))


@fuzz
@given(fields=st.dictionaries(st.sampled_from(["type", "v", "transfer_id", "keys", "chunk_bytes",
                                               "sender_id", "slot", "generation", "zzz"]),
                              st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=6),
       tag=st.sampled_from(["alloc", "hello", "challenge", "chunk_done", "abort", "slots", "bogus"]))
def test_wrongly_typed_messages_get_a_clear_rejection(receiver, dealer, fields, tag):
    fields = {"type": tag, "v": P.PROTOCOL_VERSION, **fields}
    assert_rejected(roundtrip(dealer, [msgspec.msgpack.encode(fields)]))


def test_wrong_version_oversize_and_multiframe(receiver, dealer):
    raw = msgspec.msgpack.encode({"type": "heartbeat", "v": 99, "session": b"x"})
    assert "version 99" in roundtrip(dealer, [raw]).reason
    assert roundtrip(dealer, [b"\x80" * 4500]).code == "oversize"
    assert roundtrip(dealer, [b"a", b"b"]).code == "malformed"
    assert_alive(dealer, receiver)


def test_giant_frame_drops_only_that_peer(receiver):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(receiver.endpoint)
    s.send(os.urandom(1 << 16))              # over ZMQ's MAXMSGSIZE: the connection is dropped
    s.close()
    s2 = zmq.Context.instance().socket(zmq.DEALER)
    s2.setsockopt(zmq.LINGER, 0)
    s2.connect(receiver.endpoint)
    assert_alive(s2, receiver)
    s2.close()


def test_control_messages_before_hello_are_refused(receiver, dealer):
    for msg in VALID[1:]:
        reply = roundtrip(dealer, [P.encode(msg)])
        assert reply.code == "unauthenticated", reply
    assert receiver.stats.malformed > 0
    assert_alive(dealer, receiver)
