"""The tcp data port under a flood of connections that never authenticate (real sockets, a real
receiver here and an honest sender process): idle and trickling connections cost no thread and
are closed by one overall deadline, the oldest go first beyond the cap, an honest sender's
transfer still arrives intact, and accepting survives running out of file descriptors."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import threading
import time

import msgspec

from kvrelay.bench.peer import SenderPeer
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.transport.backends import gate as gate_mod
from kvrelay.transport.backends import sockets
from kvrelay.transport.backends.sockets import SocketInfo
from tests.security.test_transport_attacks import CHUNK, drain_ok, keys_for
from tests.transport.conftest import FP, assert_no_leases, make_cfg, make_receiver


def _honest_transfer(receiver, cfg, tid: str) -> None:
    """A new sender connects, pushes two chunks; D holds exactly its bytes, then nothing."""
    peer = SenderPeer(cfg, receiver.endpoint, FP)
    try:
        peer.call("connect")
        peer.call("prepare", "src", 2 * CHUNK, 11)
        receiver.expect(tid)
        peer.call("alloc", tid, keys_for(tid, 2), [HEADER_SIZE + CHUNK] * 2)
        for i in range(2):
            peer.call("write", tid, i, "src", i * CHUNK, CHUNK)
        assert drain_ok(receiver, tid) == [peer.call("digest", "src", i * CHUNK, CHUNK) for i in range(2)]
    finally:
        peer.close()


def _address(receiver) -> tuple[str, int]:
    info = msgspec.msgpack.decode(receiver.backend.info(), type=SocketInfo)
    return info.address, info.port


def test_idle_and_trickling_connections_cost_no_thread_and_do_not_stop_an_honest_sender(monkeypatch):
    monkeypatch.setattr(sockets, "PREAMBLE_S", 1.5)       # the overall deadline, short for the test
    cfg = make_cfg("tcp", **{"timeouts.peer_s": 2.0, "timeouts.heartbeat_s": 0.2})
    receiver = make_receiver(cfg)
    addr = _address(receiver)
    threads_before = threading.active_count()
    idle = [socket.create_connection(addr) for _ in range(600)]          # more than the cap (256)
    trickle = [socket.create_connection(addr) for _ in range(20)]
    stop = threading.Event()

    def drip() -> None:                                   # a byte of a valid frame every 0.2 s
        frame = sockets.FRAME.pack(sockets.FRAME_MAGIC, sockets.FRAME_VERSION, sockets.KIND_HELLO, 0, b"\0" * 16,
                                   b"\0" * 16, 0, 0, 0, 8)
        for i in range(len(frame)):
            if stop.wait(0.2):
                return
            for s in trickle:
                with contextlib.suppress(OSError):
                    s.send(frame[i:i + 1])
    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        _honest_transfer(receiver, cfg, "honest-1")               # during the flood
        assert threading.active_count() <= threads_before + 4, "unauthenticated connections got threads"
        time.sleep(2.0)                                            # past the overall deadline
        closed = 0
        for s in trickle:
            s.settimeout(2)
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
        assert closed == len(trickle), "a trickling connection outlived the preamble deadline"
        assert receiver.backend._gate.pending == 0
        assert receiver.stats.refusals["unauthenticated_data"] >= len(idle) + len(trickle) - 1
        _honest_transfer(receiver, cfg, "honest-2")
        assert_no_leases(receiver)
    finally:
        stop.set()
        for s in idle + trickle:
            s.close()
        receiver.close()


_FLOOD = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection((host, port), timeout=2))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"""


def test_accepting_survives_running_out_of_file_descriptors():
    cfg = make_cfg("tcp", **{"timeouts.peer_s": 2.0, "timeouts.heartbeat_s": 0.2})
    receiver = make_receiver(cfg)
    addr = _address(receiver)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = None
    try:
        import os

        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 40, hard))   # this process: the receiver's
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, addr[0], str(addr[1]), "300"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None
        assert int(flood.stdout.readline()) > 40                      # the backlog took more than D could hold
        deadline = time.monotonic() + 5
        while not receiver.backend._gate.fd_exhaustions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.backend._gate.fd_exhaustions, "the flood never exhausted the receiver's descriptors"
        flood.communicate("", timeout=10)                             # the flood goes away
        flood = None
        time.sleep(0.5)
        _honest_transfer(receiver, cfg, "after-emfile")              # still accepting, same low limit
    finally:
        if flood is not None:
            flood.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        receiver.close()


def test_the_gate_closes_the_oldest_beyond_its_cap_and_each_connection_at_its_deadline():
    now = [0.0]
    refused: list[str] = []
    served: list[str] = []
    lsock = socket.create_server(("127.0.0.1", 0))
    g = gate_mod.Gate(lsock, need=lambda buf: 4, check=lambda buf: buf.decode() if buf != b"nope" else None,
                      serve=lambda conn, who: served.append(who), refused=refused.append, deadline_s=5.0,
                      max_pending=3, clock=lambda: now[0])
    t = threading.Thread(target=g.run, daemon=True)
    t.start()
    addr = lsock.getsockname()
    try:
        conns = [socket.create_connection(addr) for _ in range(5)]
        deadline = time.monotonic() + 5
        while len(refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused == ["too many connections without a preamble"] * 2 and g.pending == 3
        conns[4].sendall(b"ab")                              # half a preamble
        conns[3].sendall(b"good")                            # a whole one
        while not served and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served == ["good"]
        now[0] = 5.1                                          # everything left is past its deadline
        while g.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert g.pending == 0 and len(refused) == 4
        assert conns[4].recv(1) == b""
    finally:
        g.close()
        t.join(2)
        lsock.close()
        assert not t.is_alive()
