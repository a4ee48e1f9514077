"""Attacks on the transfer endpoint, over real sockets, while an honest sender is mid-transfer.

Every attack must be refused and counted by cause (``ReceiverStats.refusals``, exported as
``kvrelay_receiver_refusals_total{cause}``), leave no slot, receiver entry or dead peer behind,
and the honest transfer must still deliver bytes equal to its source's digest.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

import msgspec
import pytest
import zmq

from kvrelay.bench.peer import SenderPeer
from kvrelay.common.secrets import KeyUse, derive_key
from kvrelay.common.wire import HEADER_SIZE, make_header, transfer_tag
from kvrelay.transport import protocol as P
from kvrelay.transport.backends.sockets import (
    FRAME,
    FRAME_MAGIC,
    FRAME_VERSION,
    KIND_CHUNK,
    KIND_HELLO,
    SocketInfo,
)
from kvrelay.transport.events import ChunkArrival, TransferDone
from tests.transport.conftest import FP, assert_no_leases, keys_for, make_cfg, make_receiver

SECRET = os.environ["KVRELAY_SECRET"].encode()
CHUNK = 64 << 10


def dealer(endpoint: str, identity: bytes) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def ask(sock: zmq.Socket, msg: P.Message) -> P.Message:
    sock.send(P.encode(msg))
    assert sock.poll(5000), "the receiver did not answer"
    return P.decode(sock.recv(), 1 << 20)


def signed_hello(sock: zmq.Socket, sender: str, backend: str = "tcp", info: bytes = b"") -> P.Hello:
    """What an honest sender would say (the attacker sniffed it, or it is the honest sender)."""
    ack = ask(sock, P.Challenge(sender_id=sender))
    assert isinstance(ack, P.ChallengeAck)
    hello = P.Hello(sender_id=sender, fingerprint=FP, backend=backend, nonce=os.urandom(32),
                    challenge=ack.challenge, info=info)
    return P.sign_hello(derive_key(SECRET, KeyUse.HELLO), hello)


def drain_ok(receiver, tid: str) -> list[str]:
    digests = []
    while True:
        ev = receiver.next_event(tid, 10)
        if isinstance(ev, ChunkArrival):
            digests.append(hashlib.sha256(receiver.payload(ev)).hexdigest())
            receiver.release(ev)
        else:
            assert isinstance(ev, TransferDone) and ev.rejected == 0, ev
            receiver.finish(tid)
            return digests


@pytest.fixture
def honest():
    """A tcp receiver here and an honest sender process mid-transfer: chunk 0 granted, not yet written."""
    cfg = make_cfg("tcp", **{"timeouts.peer_s": 2.0, "timeouts.heartbeat_s": 0.2})
    receiver = make_receiver(cfg)
    peer = SenderPeer(cfg, receiver.endpoint, FP)
    try:
        sender = peer.call("connect")
        peer.call("prepare", "src", 2 * CHUNK, 7)
        receiver.expect("t1")
        peer.call("alloc", "t1", keys_for("t1", 2), [HEADER_SIZE + CHUNK] * 2)
        yield receiver, peer, sender
    finally:
        peer.close()
        receiver.close()


def finish_honest(receiver, peer) -> None:
    """The honest sender writes both chunks; D must hold exactly its bytes, then nothing at all."""
    for i in range(2):
        peer.call("write", "t1", i, "src", i * CHUNK, CHUNK)
    assert drain_ok(receiver, "t1") == [peer.call("digest", "src", i * CHUNK, CHUNK) for i in range(2)]
    assert receiver.stats.peers_dead == 0
    assert_no_leases(receiver)
    assert not any(receiver.tracked().values()), receiver.tracked()


def test_unauthenticated_data_connection_cannot_write_a_chunk(honest):
    receiver, peer, sender = honest
    info = msgspec.msgpack.decode(receiver.backend.info(), type=SocketInfo)
    slot = receiver.table.transfers["t1"].slots[0]
    key = keys_for("t1", 2)[0]
    evil = b"\xee" * CHUNK
    header = make_header(key, "t1", 0, [evil]).pack()
    frame = FRAME.pack(FRAME_MAGIC, FRAME_VERSION, KIND_CHUNK, 0, transfer_tag("t1"), b"\0" * 16, 0,
                       slot.index, slot.generation, HEADER_SIZE + CHUNK)
    for token in (b"", os.urandom(32)):           # no preamble at all; a preamble naming the sender
        with socket.create_connection((info.address, info.port)) as s:
            if token:
                name = sender.encode()
                s.sendall(FRAME.pack(FRAME_MAGIC, FRAME_VERSION, KIND_HELLO, 0, b"\0" * 16, b"\0" * 16, 0, 0, 0,
                                     len(name)) + name + token)
            try:
                s.sendall(frame + header + evil)
                s.settimeout(5)
                closed = s.recv(1) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            assert closed, "D must close an unauthenticated data connection"
    deadline = time.monotonic() + 5
    while receiver.stats.refusals["unauthenticated_data"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.stats.refusals["unauthenticated_data"] == 2
    assert receiver.stats.chunks_arrived == 0          # nothing was accepted from the attacker
    finish_honest(receiver, peer)                       # and the spoofed close did not kill the sender


def test_write_into_another_senders_slot_is_refused(honest):
    """An authenticated sender (it holds the secret) still cannot write a transfer it does not own."""
    receiver, peer, _ = honest
    from kvrelay.core import config
    from kvrelay.transport.backends import make_sender_backend
    from kvrelay.transport.sender import Sender

    cfg = make_cfg("tcp")
    with Sender(cfg.transport, cfg.timeouts, receiver.endpoint, make_sender_backend(cfg.transport), FP) as other:
        other.connect()
        slot = receiver.table.transfers["t1"].slots[1]
        forged = P.Grant(chunk_index=1, slot=slot.index, generation=slot.generation,
                         offset=receiver.pool.offset(slot), token=os.urandom(16))
        evil = b"\xee" * CHUNK
        header = make_header(keys_for("t1", 2)[1], "t1", 1, [evil]).pack()
        other.backend.write("t1", 1, header, [evil], forged)
        deadline = time.monotonic() + 5
        while receiver.stats.refusals["foreign"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert receiver.stats.refusals["foreign"] == 1
    assert config is not None
    finish_honest(receiver, peer)


def test_replayed_hello_is_refused(honest):
    receiver, peer, _ = honest
    first = dealer(receiver.endpoint, b"mallory")
    hello = signed_hello(first, "mallory")
    ack = ask(first, hello)
    assert isinstance(ack, P.HelloAck) and ack.ok                      # the original is fine
    for sock in (first, dealer(receiver.endpoint, b"mallory-2")):      # the same bytes again, twice
        ack = ask(sock, hello)
        assert isinstance(ack, P.HelloAck) and not ack.ok and "challenge" in ack.reason
        sock.close()
    assert receiver.stats.refusals["replay"] == 2
    finish_honest(receiver, peer)


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_hello_with_tampered_info_is_refused(backend):
    cfg = make_cfg(backend)
    with make_receiver(cfg) as receiver:
        sock = dealer(receiver.endpoint, b"mallory")
        hello = signed_hello(sock, "mallory", backend, info=b"honest metadata")
        ack = ask(sock, msgspec.structs.replace(hello, info=b"attacker's NIXL agent"))
        assert isinstance(ack, P.HelloAck) and not ack.ok and "HMAC" in ack.reason
        assert ack.info == b"", "D's backend info (e.g. NIXL metadata) must not reach an unauthenticated peer"
        assert receiver.stats.refusals["bad_mac"] == 1
        sock.close()


def test_spoofed_bye_abort_and_heartbeat_are_refused(honest):
    receiver, peer, sender = honest
    session = receiver._gate._session_of[sender]          # what an eavesdropper could learn
    sock = dealer(receiver.endpoint, sender.encode() + b"/spoof")
    spoofs = [P.Bye(), P.Abort(transfer_id="t1", reason="spoof"), P.Heartbeat(channel=1),
              P.Bye(session=session, seq=10**6, mac=os.urandom(32)),
              P.Abort(transfer_id="t1", session=session, seq=10**6, mac=os.urandom(32)),
              P.Heartbeat(session=session, seq=10**6, mac=os.urandom(32))]
    for msg in spoofs:
        reply = ask(sock, msg)
        assert isinstance(reply, P.Error) and reply.code == "unauthenticated", reply
    sock.close()
    assert receiver.stats.refusals["no_session"] == 3 and receiver.stats.refusals["bad_mac"] == 3
    assert receiver.stats.aborts == 0
    time.sleep(2.5)                     # > peer_s: only the real (sealed) heartbeats keep the sender alive
    finish_honest(receiver, peer)
