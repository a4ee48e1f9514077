"""The prefill push engine against real decode-side receivers (tcp) - hardening failure modes:

1. a failed push with writes still in flight settles (vLLM gets its blocks back) and the
   push thread goes idle instead of spinning;
2. a decode node that restarts on the same endpoint is pushed to again without restarting P;
10. a dead decode node stalls only its own lane: pushes to a healthy one go on meanwhile;
11. an Alloc that D parks (its pool is full) does not hold up its lane: the pushes already
    granted go on, and their slots coming free is what lets the parked one through.

``PushWorker`` runs as in vLLM's worker (a CPU KV cache it registers, specs from the
scheduler), minus vLLM itself; the receivers, sockets and ZeroMQ are real.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.common.wire import HEADER_SIZE  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core.fingerprint import engine_fingerprint  # noqa: E402
from kvrelay.kernels.layout import KVLayout  # noqa: E402
from kvrelay.prefill.pusher import PushWorker  # noqa: E402
from kvrelay.prefill.specs import PushSpec  # noqa: E402
from kvrelay.transport.backends import make_receiver_backend  # noqa: E402
from kvrelay.transport.backends.base import WriteHandle, WriteState  # noqa: E402
from kvrelay.transport.backends.sockets import SocketSender  # noqa: E402
from kvrelay.transport.events import TransferDone  # noqa: E402
from kvrelay.transport.receiver import Receiver  # noqa: E402
from tests.helpers import consume_transfer, gather_to_host  # noqa: E402

L, NB, H, BS, D2 = 2, 64, 2, 16, 32          # layers, blocks, kv heads, block size, 2*head
T = 32                                        # chunk_tokens: 2 blocks


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="t", max_model_len=4096),
                           parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1),
                           kv_transfer_config=SimpleNamespace(engine_id="pusher-test"))


def make_cfg(**over: object) -> kcfg.KVRelayConfig:
    items = {"chunk_tokens": T, "transport.backend": "tcp", "transport.pool_bytes": "4MiB",
             "timeouts.peer_s": 2, "timeouts.heartbeat_s": 0.2, "timeouts.connect_s": 8,
             "connector.free_deadline_s": 2, "connector.helper_cpus": "inherit", **over}
    return kcfg.load(overrides=[f"{k}={v}" for k, v in items.items()])


class Node:
    """A decode node's receive side and a consumer thread that checks every chunk's bytes."""

    def __init__(self, cfg: kcfg.KVRelayConfig, worker: PushWorker, port: int = 0) -> None:
        assert worker.layout is not None
        tc = kcfg.from_dict({**kcfg.to_dict(cfg), "transport": {**kcfg.to_dict(cfg)["transport"],
                                                                  "control_port": port}}).transport
        slot = HEADER_SIZE + worker.layout.chunk_bytes(T // BS)
        self.receiver = Receiver(tc, cfg.timeouts, make_receiver_backend(tc), worker.transfer_digest,
                                 slot_bytes=slot, consumer_wait_s=0.5)
        self.endpoint = self.receiver.endpoint
        self.worker = worker

    def expect(self, tid: str, block_ids: list[int], n_chunks: int) -> dict:
        """Consume transfer ``tid`` on a thread; the result dict fills in when it ends."""
        self.receiver.expect(tid)
        out: dict = {"arrived": {}, "end": None}

        def check(c: int, data: bytes) -> None:
            blocks = block_ids[c * 2:(c + 1) * 2]
            out["arrived"][c] = data == gather_to_host(self.worker.layout, blocks).numpy().tobytes()

        def consume() -> None:
            out["end"] = consume_transfer(self.receiver, tid, check, 10)

        out["thread"] = threading.Thread(target=consume, daemon=True)
        out["thread"].start()
        return out

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    buf = torch.randn((L, NB, H, BS, D2), generator=torch.Generator().manual_seed(5))
    return {f"layers.{i}.attn": buf[i] for i in range(L)}


def start_worker(cfg: kcfg.KVRelayConfig, caches: dict[str, torch.Tensor], **kw: object) -> PushWorker:
    w = PushWorker(cfg, vllm_config(), **kw)
    w.register(caches)
    assert w.fingerprint == engine_fingerprint(vllm_config(), KVLayout.from_caches(caches), cfg)
    return w


def push(worker: PushWorker, endpoint: str, n_chunks: int, first_block: int) -> tuple[str, str, list[int]]:
    """Hand the worker one fully computed prompt, then finish the request (as the scheduler does)."""
    rid, tid = f"r-{uuid.uuid4().hex[:6]}", f"t-{uuid.uuid4().hex[:6]}"
    n = n_chunks * T
    blocks = list(range(first_block, first_block + 2 * n_chunks))
    worker.on_step([PushSpec(rid, tid, endpoint, n, blocks, n, token_ids=list(range(first_block, first_block + n)))],
                   [])
    worker.on_step([], [rid])
    return rid, tid, blocks


_SETTLED: dict[int, set[str]] = {}        # per worker: every request it reported (take_finished drains)


def wait_settled(worker: PushWorker, rid: str, timeout: float) -> float:
    t0 = time.monotonic()
    done = _SETTLED.setdefault(id(worker), set())
    while rid not in done:
        assert time.monotonic() - t0 < timeout, f"{rid} never settled (its blocks would never be freed)"
        done |= worker.take_finished()
        time.sleep(0.02)
    return time.monotonic() - t0


class StuckAfterFirst(SocketSender):
    """A real tcp sender whose writes after chunk 0 never report completion - what P sees
    when D dies with writes in flight (a NIXL WRITE stays in PROC)."""

    def write(self, transfer_id, chunk_index, header, payload, grant) -> WriteHandle:
        handle = super().write(transfer_id, chunk_index, header, payload, grant)
        if chunk_index > 0:
            handle.state = WriteState.POSTED
        return handle


def test_failed_push_with_writes_in_flight_settles_and_goes_idle(caches):
    cfg = make_cfg()
    worker = start_worker(cfg, caches, make_backend=lambda tc: StuckAfterFirst(inline_payload=True))
    node = Node(cfg, worker)
    try:
        rid, tid, blocks = push(worker, node.endpoint, 4, 8)
        node.expect(tid, blocks, 4)
        took = wait_settled(worker, rid, timeout=10)
        assert took >= 1.5                                     # failed at free_deadline_s (2 s), not at once
        assert not worker.busy()
        assert worker.payloads.staging is not None and worker.payloads.staging.stats().lent == 0   # the stuck writes' buffers retired
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
        assert cpu < 0.3, f"push threads spin at {cpu:.0%} of a core with nothing to do"
    finally:
        worker.close()
        node.close()


def test_concurrent_pushes_gather_into_reused_buffers_and_arrive_exact(caches):
    """Three prompts pushed at once, three times over: every chunk D receives is byte-identical
    to its blocks in P's cache although the gather buffers are lent again as soon as a write is
    done, and none stays lent once the pushes settled."""
    cfg = make_cfg()
    worker = start_worker(cfg, caches)
    node = Node(cfg, worker)
    try:
        for _ in range(3):
            pushes = [push(worker, node.endpoint, 3, first) for first in (0, 8, 16)]
            got = [node.expect(tid, blocks, 3) for _rid, tid, blocks in pushes]
            for (rid, _tid, _blocks), g in zip(pushes, got, strict=True):
                wait_settled(worker, rid, 15)
                g["thread"].join(15)
                assert isinstance(g["end"], TransferDone), g["end"]
                assert g["arrived"] == {0: True, 1: True, 2: True}
        assert worker.payloads.staging is not None
        st = worker.payloads.staging.stats()
        assert st.lent == 0 and st.made == st.free and st.made < 27 and st.reused + st.made + st.misses == 27
    finally:
        worker.close()
        node.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_decode_node_restart_on_the_same_endpoint_is_pushed_to_again(caches):
    cfg = make_cfg()
    worker = start_worker(cfg, caches)
    port = free_port()
    node = Node(cfg, worker, port)
    try:
        rid, tid, blocks = push(worker, node.endpoint, 2, 4)
        got = node.expect(tid, blocks, 2)
        wait_settled(worker, rid, 10)
        got["thread"].join(10)
        assert isinstance(got["end"], TransferDone) and got["arrived"] == {0: True, 1: True}
        node.close()
        node = Node(cfg, worker, port)                          # D restarts: same endpoint, new identity
        for first in (12, 20):
            rid, tid, blocks = push(worker, node.endpoint, 2, first)
            got = node.expect(tid, blocks, 2)
            wait_settled(worker, rid, 15)
            got["thread"].join(15)
            assert isinstance(got["end"], TransferDone), got["end"]
            assert got["arrived"] == {0: True, 1: True}, "pushes to the restarted node were not loaded"
    finally:
        worker.close()
        node.close()


def test_a_dead_decode_node_stalls_only_its_own_lane(caches):
    cfg = make_cfg()
    worker = start_worker(cfg, caches)
    silent = socket.socket()                                    # accepts connections, never speaks ZeroMQ
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    node = Node(cfg, worker)
    try:
        dead_rid, _, _ = push(worker, f"tcp://127.0.0.1:{silent.getsockname()[1]}", 2, 30)
        time.sleep(0.1)                                         # its lane is now blocked in connect
        t0 = time.monotonic()
        rid, tid, blocks = push(worker, node.endpoint, 2, 40)
        got = node.expect(tid, blocks, 2)
        wait_settled(worker, rid, 10)
        took = time.monotonic() - t0
        got["thread"].join(5)
        assert got["arrived"] == {0: True, 1: True}
        assert took < cfg.timeouts.connect_s / 2, f"healthy node waited {took:.2f}s behind a dead one"
        wait_settled(worker, dead_rid, 30)                      # the dead one fails and settles too
        t0 = time.monotonic()                                   # more pushes to the dead node fail at once,
        rids = [push(worker, f"tcp://127.0.0.1:{silent.getsockname()[1]}", 1, 50 + 2 * i)[0] for i in range(4)]
        for r in rids:                                          # not one connect_s each
            wait_settled(worker, r, 15)
        assert time.monotonic() - t0 < cfg.timeouts.connect_s, "each push to a dead node waited for a connect"
    finally:
        worker.close()
        node.close()
        silent.close()


def test_an_alloc_parked_on_a_full_pool_does_not_hold_up_the_granted_pushes(caches):
    """A holds D's pool (4 slots: 2 filled and released, 2 waiting for chunks P has still to
    compute); B needs 3 slots, so its Alloc parks.
    With a lane that waits for B's answer, A's last chunks wait behind it, A's slots never
    free, and B is refused after alloc_wait_s (a deadlock broken only by the timeout). The
    lane must go on writing A while B parks, then B gets A's slots and is delivered too."""
    slot = -(-(HEADER_SIZE + 2 * L * H * BS * D2 * 4) // 4096) * 4096   # a chunk (2 blocks of every layer), paged
    cfg = make_cfg(**{"transport.pool_bytes": 4 * slot, "timeouts.alloc_wait_s": 6,
                      "connector.free_deadline_s": 20})
    worker = start_worker(cfg, caches)
    node = Node(cfg, worker)
    assert node.receiver.pool.num_slots == 4
    try:
        a_blocks, b_blocks = list(range(0, 8)), list(range(8, 14))
        tokens = list(range(4 * T))
        got_a, got_b = node.expect("A", a_blocks, 4), node.expect("B", b_blocks, 3)
        worker.on_step([PushSpec("ra", "A", node.endpoint, 4 * T, a_blocks, 2 * T, token_ids=tokens)], [])
        deadline = time.monotonic() + 5
        while len(got_a["arrived"]) < 2:                        # A's first two chunks are in
            assert time.monotonic() < deadline, "A's first chunks never arrived"
            time.sleep(0.02)
        worker.on_step([PushSpec("rb", "B", node.endpoint, 3 * T, b_blocks, 3 * T, token_ids=tokens[:3 * T])],
                       ["rb"])
        time.sleep(0.3)                                         # B's Alloc is parked at D now
        t0 = time.monotonic()
        worker.on_step([PushSpec("ra", "A", node.endpoint, 4 * T, a_blocks, 4 * T)], ["ra"])
        got_a["thread"].join(10)
        took = time.monotonic() - t0
        assert isinstance(got_a["end"], TransferDone) and got_a["arrived"] == dict.fromkeys(range(4), True)
        assert took < 2, f"A's last chunks waited {took:.1f} s behind B's parked Alloc"
        got_b["thread"].join(10)
        assert isinstance(got_b["end"], TransferDone), f"B was not delivered: {got_b['end']}"
        assert got_b["arrived"] == dict.fromkeys(range(3), True)
        wait_settled(worker, "ra", 10)
        wait_settled(worker, "rb", 10)
        st = node.receiver.pool.stats()
        assert st.leased == st.filled == 0, st
    finally:
        worker.close()
        node.close()


class BlocksOnSecond(SocketSender):
    """A real tcp sender whose send of chunk 1 blocks until released - what a push sees when D
    stops reading and the socket's buffer is full."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.sending, self.release = threading.Event(), threading.Event()

    def write(self, transfer_id, chunk_index, header, payload, grant) -> WriteHandle:
        if chunk_index == 1:
            self.sending.set()
            self.release.wait(30)
        return super().write(transfer_id, chunk_index, header, payload, grant)


def test_preemption_never_waits_for_a_blocked_send(caches):
    """Preemption on P (vLLM's model thread, before its next forward) waits for gathers that read
    the request's blocks, not for a network send: before the fix the push's guard was held across
    the tcp send, so a slow D held up P's scheduler step for as long as the send blocked."""
    cfg = make_cfg()
    sender = BlocksOnSecond(inline_payload=True)
    worker = start_worker(cfg, caches, make_backend=lambda tc: sender)
    node = Node(cfg, worker)
    try:
        rid, tid, blocks = push(worker, node.endpoint, 4, 8)
        node.expect(tid, blocks, 4)
        assert sender.sending.wait(10), "chunk 1 was never sent"
        t0 = time.monotonic()
        threading.Timer(3.0, sender.release.set).start()       # the send unblocks 3 s from now
        worker.preempt([rid])
        took = time.monotonic() - t0
        assert took < 1.0, f"preemption waited {took:.1f} s for a blocked send"
        wait_settled(worker, rid, timeout=15)
        deadline = time.monotonic() + 10
        while worker.busy() or worker.payloads.staging.stats().lent:
            assert time.monotonic() < deadline, "a buffer or the push was left behind"
            time.sleep(0.05)
    finally:
        sender.release.set()
        worker.close()
        node.close()
