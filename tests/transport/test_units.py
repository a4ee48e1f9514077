"""Unit tests of the pieces under the backends: keys, wire format, pool state machine."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvrelay.common.errors import ChecksumError, ChunkError, PoolFullError, TransportError
from kvrelay.common.keys import Fingerprint, chunk_keys
from kvrelay.common.wire import (
    COPY_PIECE,
    FUSE_FROM,
    HEADER_SIZE,
    copy_checked,
    make_header,
    parse_header,
    verify_chunk,
)
from kvrelay.transport.pool import ReceivePool, SlotRef, SlotState

FP = Fingerprint("tiny", "bf16", "cpu", 128, 4, 65536)


def test_keys_chain_over_the_prefix_and_fingerprint():
    toks = list(range(1000))
    k = chunk_keys(toks, FP, 256)
    assert len(k) == 4 and all(len(x) == 32 for x in k)
    # independent reference: sha256(prev || int64-le tokens || fp digest)
    import struct

    prev = b"\0" * 32
    for i in range(4):
        part = toks[i * 256:(i + 1) * 256]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(part)}q", *part) + FP.digest()).digest()
        assert k[i] == prev
    other = chunk_keys([5] + toks[1:], FP, 256)
    assert all(a != b for a, b in zip(k, other, strict=True))          # chained: chunk 0 differs -> all differ
    assert chunk_keys(toks, FP, 256)[:3] == chunk_keys(toks[:800], FP, 256)[:3]
    assert chunk_keys(toks, Fingerprint("tiny", "fp16", "cpu", 128, 4, 65536), 256)[0] != k[0]
    assert chunk_keys(toks[:999], FP, 256)[3] != k[3]                   # tail length matters


def _chunk(payload: bytes, **kw) -> bytearray:
    hdr = make_header(b"k" * 32, "tid", 3, [payload], **kw).pack()
    return bytearray(hdr + payload)


def test_wire_roundtrip_and_detection():
    payload = os.urandom(4 * 2 * 512)
    buf = _chunk(payload, num_layers=4, num_blocks=2)
    hdr = verify_chunk(buf, transfer_id="tid", key=b"k" * 32, chunk_index=3)
    assert (hdr.num_layers, hdr.num_blocks, hdr.block_bytes) == (4, 2, 512)
    assert bytes(buf[HEADER_SIZE:]) == payload
    bad = bytearray(buf)
    bad[HEADER_SIZE + 100] ^= 1
    with pytest.raises(ChecksumError):
        verify_chunk(bad)
    with pytest.raises(ChunkError, match="misrouted"):
        verify_chunk(buf, transfer_id="other")
    with pytest.raises(ChunkError, match="misrouted"):
        verify_chunk(buf, chunk_index=4)
    with pytest.raises(ChunkError, match="truncated"):
        verify_chunk(buf[:-1])
    with pytest.raises(ChunkError, match="truncated header"):
        parse_header(buf[:50])
    hdr_bad = bytearray(buf)
    hdr_bad[60] ^= 1                                              # inside the header
    with pytest.raises(ChunkError, match="header checksum"):
        verify_chunk(hdr_bad)
    with pytest.raises(ChunkError, match="magic"):
        verify_chunk(b"XXXX" + bytes(buf[4:]))


@pytest.mark.parametrize("size", [1, FUSE_FROM - 1, FUSE_FROM, FUSE_FROM + COPY_PIECE // 3 + 7])
def test_copy_checked_copies_every_byte_and_catches_a_flip_in_any_piece(size):
    """Below FUSE_FROM one copy and one hash; from it on, pieces (the last one short here)."""
    payload = bytearray(os.urandom(size))
    hdr = make_header(b"k" * 32, "tid", 0, [payload])
    dst = bytearray(size)
    copy_checked(hdr, payload, dst)
    assert dst == payload                                         # every byte, none left over
    for at in {0, size // 2, size - 1}:                           # first, middle and last piece
        bad = bytearray(payload)
        bad[at] ^= 0x40
        with pytest.raises(ChecksumError, match="chunk 0"):
            copy_checked(hdr, bad, bytearray(size))
    with pytest.raises(ValueError, match="destination"):
        copy_checked(hdr, payload, bytearray(size + 1))


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_pool_state_machine_and_leases():
    clock = FakeClock()
    pool = ReceivePool(4 * 8192, 8000, lease_s=5, clock=clock, pin=False)
    try:
        assert pool.num_slots == 4 and pool.slot_bytes == 8192
        a = pool.allocate(3, "t1", timeout=0)
        assert pool.try_allocate(2, "t2") is None
        with pytest.raises(PoolFullError):
            pool.allocate(2, "t2", timeout=0)
        pool.mark_filled(a[0])
        pool.take(a[0])
        pool.retain(a[0])
        assert not pool.release(a[0])
        assert pool.release(a[0])
        with pytest.raises(TransportError, match="stale"):
            pool.release(a[0])                                    # double free is rejected
        pool.mark_filled(a[1])
        clock.t = 10                                              # a[1] filled but unconsumed, a[2] unfilled
        expired = pool.reap_expired()
        assert {(r, s) for r, _, s in expired} == {(a[1], SlotState.FILLED), (a[2], SlotState.LEASED)}
        st = pool.stats()
        assert st.free == 4 and st.leases_expired == 2
        b = pool.allocate(1, "t3", timeout=0)[0]
        with pytest.raises(TransportError, match="stale"):
            pool.mark_filled(SlotRef(b.index, b.generation - 1))  # late write for an old generation
        pool.begin_write(b)
        clock.t = 100
        assert pool.reap_expired() == []                           # in-progress writes are not reaped
        pool.end_write(b)
        assert len(pool.reap_expired()) == 1
        with pytest.raises(PoolFullError):
            pool.allocate(5, "big", timeout=0)
    finally:
        pool.close()


def test_release_owner_keeps_held_slots():
    pool = ReceivePool(3 * 4096, 4096, pin=False)
    try:
        r = pool.allocate(3, "t", timeout=0)
        pool.mark_filled(r[0])
        pool.take(r[0])
        pool.mark_filled(r[1])
        assert pool.release_owner("t") == 2
        st = pool.stats()
        assert st.held == 1 and st.free == 2
        pool.release(r[0])
    finally:
        pool.close()


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.parametrize("shared", [False, True])
def test_the_pool_is_resident_before_its_first_chunk(shared):
    """A new pool has every page faulted in (private: anonymous RSS; shared: shmem RSS), so
    no chunk pays for allocating and zeroing its slot's pages inside the transport's copy;
    an attached view of a shared pool maps them at once too."""
    from kvrelay.transport.arenas import SharedArena

    field = "RssShmem" if shared else "RssAnon"
    before = _rss_kib(field)
    pool = ReceivePool(64 << 20, 2 << 20, pin=False, shared=shared)
    try:
        if _kernel() < (5, 14):                              # no MADV_POPULATE_WRITE: lazy, with a warning
            assert not pool.populated
            pytest.skip(f"Linux {os.uname().release} cannot MADV_POPULATE_WRITE (5.14+)")
        assert pool.populated
        assert _rss_kib(field) - before >= 60 << 10          # KiB: ~all of the 64 MiB
        if shared:
            peer = SharedArena(0, name=pool.arena.name, create=False)
            try:
                peer.buf[-1:] = b"x"                           # writable, no SIGBUS
                assert pool.arena.buf[-1:] == b"x"
            finally:
                peer.close()
    finally:
        pool.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_closed_receivers_port_binds_again_at_once_and_a_taken_port_fails_cleanly(backend):
    """close() returns only once the control endpoint is unbound (a decode node restarted in
    the same process rebinds its port - ZeroMQ unbinds asynchronously on a shared context). A
    port someone else holds is a clear TransportError that leaves no pool behind."""
    import socket

    import zmq

    from tests.transport.conftest import make_cfg, make_receiver

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(backend, **{"transport.control_port": port})
    peer = zmq.Context.instance().socket(zmq.DEALER)          # a sender that keeps reconnecting
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(30):
            make_receiver(cfg).close()
    finally:
        peer.close(linger=0)
    shm_before = set(os.listdir("/dev/shm"))
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # the peer's old connections
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(TransportError, match=f"cannot bind the control endpoint tcp://127.0.0.1:{port}"):
            make_receiver(cfg)
    assert set(os.listdir("/dev/shm")) == shm_before


def test_ucxx_imported_from_racing_threads_leaves_the_environment_as_it_was():
    """Importing ucxx writes CUDA-tuned ``UCX_*`` variables (``UCX_RNDV_FRAG_MEM_TYPE=cuda``
    ...) that the backend removes again; lane threads that create their senders at once must not
    restore them for good. In a fresh interpreter: the import is what is under test."""
    import subprocess
    import sys

    pytest.importorskip("ucxx")
    code = ("import os, threading\n"
            "from kvrelay.transport.backends.ucx import _import_ucxx\n"
            "before = {k for k in os.environ if k.startswith('UCX_')}\n"
            "import time\n"
            "def run(i):\n"
            "    time.sleep(i * 0.005); _import_ucxx()\n"    # staggered over the whole import
            "ts = [threading.Thread(target=run, args=(i,)) for i in range(200)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print(sorted({k for k in os.environ if k.startswith('UCX_')} - before))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_progress_loop_idles_until_woken_and_backs_off_only_without_progress():
    """The receive backends' progress thread (nixl, ucx): no step while idle and not woken; a
    wake restarts the backoff; progress resets it, no progress waits, None (the step waited by
    itself) does neither; setting ``closed`` ends it."""
    import threading
    import time

    from kvrelay.common.polling import Backoff, progress_loop

    class Recorder(Backoff):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[str] = []

        def reset(self) -> None:
            self.log.append("reset")

        def wait(self) -> bool:
            self.log.append("wait")
            return True

    closed, wake, backoff = threading.Event(), threading.Event(), Recorder()
    script = [True, False, None]
    busy = {"on": False}

    def step() -> bool | None:
        result = script.pop(0) if script else None
        backoff.log.append(f"step:{result}")
        if not script:
            busy["on"] = False                         # nothing left to drive: go idle
            closed.set()
        return result

    t = threading.Thread(target=progress_loop, args=(closed, wake, lambda: busy["on"], step, backoff))
    t.start()
    time.sleep(0.2)
    assert backoff.log == []                           # idle, not woken: never stepped
    busy["on"] = True
    wake.set()
    t.join(5)
    assert not t.is_alive()
    assert backoff.log == ["reset", "step:True", "reset", "step:False", "wait", "step:None"]


def test_the_store_event_publishers_port_binds_again_at_once_after_close():
    """The store's event publisher listens on a fixed port too: closing it frees the port at
    once (a prefill node's store restarted in the same process), and a taken port is a clear
    TransportError."""
    import socket

    import zmq

    from kvrelay.store.publisher import Publisher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    router = zmq.Context.instance().socket(zmq.SUB)           # a subscriber that keeps reconnecting
    router.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(30):
            Publisher("127.0.0.1", port, b"salt").close()
    finally:
        router.close(linger=0)
    first = Publisher("127.0.0.1", port, b"salt")
    try:
        with pytest.raises(TransportError, match=f"cannot bind the store event publisher tcp://127.0.0.1:{port}"):
            Publisher("127.0.0.1", port, b"salt")
    finally:
        first.close()


def test_parking_grants_oldest_first_refuses_late_and_withdraws_by_sender():
    from kvrelay.transport import protocol as P
    from kvrelay.transport.ledger import ParkedAlloc, Parking

    def parked(sender: str, tid: str, deadline: float) -> ParkedAlloc:
        return ParkedAlloc(b"", sender, P.Alloc(transfer_id=tid, keys=[], chunk_bytes=[], wait_s=1.0), deadline)

    parking = Parking()
    for sender, tid, deadline in (("a", "t1", 5.0), ("b", "t2", 1.0), ("a", "t3", 5.0), ("b", "t1", 5.0)):
        parking.park(parked(sender, tid, deadline))
    assert parking.withdraw("b", "t3") is None                # not b's
    assert parking.withdraw("a", "t1").sender_id == "a" and len(parking) == 3
    offered, refused = [], []
    budget = [1]                                               # room for one grant

    def grant(p: ParkedAlloc) -> bool:
        offered.append(p.msg.transfer_id)
        if budget[0]:
            budget[0] -= 1
            return True
        return False

    parking.sweep(2.0, grant, lambda p: refused.append(p.msg.transfer_id))
    assert offered == ["t2", "t3", "t1"]                       # arrival order
    assert refused == [] and len(parking) == 2                 # t2 granted before its deadline mattered
    parking.sweep(6.0, lambda p: False, lambda p: refused.append(p.msg.transfer_id))
    assert refused == ["t3", "t1"] and len(parking) == 0


def test_the_data_mac_rides_in_the_header_and_binds_its_fields_and_payload():
    import dataclasses

    from kvrelay.common.errors import ChecksumError, ConfigError
    from kvrelay.common.wire import NO_MAC, DataMac, make_header, parse_header
    from kvrelay.transport.config import PoolDevice, TransportConfig

    payload = [b"\x01" * 64, b"\x02" * 64]
    mac = DataMac(b"k" * 32)
    hdr = make_header(b"K" * 32, "t1", 3, payload, num_layers=2, mac=mac)
    back = parse_header(hdr.pack())
    assert back.mac == hdr.mac != NO_MAC and back.version == 2
    mac.check(back, payload)
    for forged, regions in ((dataclasses.replace(back, chunk_index=4), payload),     # moved to another index
                            (back, [b"\x01" * 64, b"\x03" * 64])):                  # other bytes
        with pytest.raises(ChecksumError, match="MAC"):
            mac.check(forged, regions)
    with pytest.raises(ChecksumError, match="MAC"):
        DataMac(b"x" * 32).check(back, payload)                                  # another secret
    old = bytearray(hdr.pack())
    old[4:6] = (1).to_bytes(2, "little")                                         # a version-1 peer
    with pytest.raises(Exception, match="wire version 1"):
        parse_header(bytes(old))
    assert TransportConfig().data_signer() is None                               # off by default
    with pytest.raises(ConfigError, match="data_mac"):
        TransportConfig(data_mac=True, pool_device=PoolDevice.GPU)
    assert TransportConfig(data_mac=True).pool_on("cuda:0", writes_device=True) is None     # auto: host pool
