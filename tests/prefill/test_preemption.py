"""Preemption on the prefill node, driven through the real connector halves and real KV bytes.

vLLM 0.32 frees a preempted request's blocks at once and, when the request resumes, sends a
*replacement* block list (``CachedRequestData.resumed_req_ids``). A connector that appends it
instead gathers later chunks from blocks that now hold other bytes: they travel with a valid
checksum over the wrong KV and are installed silently, and the store keeps them under the
right key. A prefill node is hard to make preempt on a 2-core host (``shared/FACTS.md``), so
this test plays vLLM's scheduler: the :class:`PrefillScheduler` and :class:`PushWorker` are
the real ones, as are the CPU KV cache, the decode node's receiver (tcp), and the store.

Every byte that reaches the decode node, and every record the store holds for the request,
is compared with the request's own KV, computed independently of the blocks it sat in.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.common.keys import chunk_keys  # noqa: E402
from kvrelay.common.wire import HEADER_SIZE  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core import params as pd  # noqa: E402
from kvrelay.prefill.connector import PrefillScheduler  # noqa: E402
from kvrelay.prefill.lookup import StoreClient, lookup_endpoint  # noqa: E402
from kvrelay.prefill.pusher import PushWorker  # noqa: E402
from kvrelay.store.records import read_record  # noqa: E402
from kvrelay.transport.backends import make_receiver_backend  # noqa: E402
from kvrelay.transport.events import TransferDone, TransferFailed  # noqa: E402
from kvrelay.transport.receiver import Receiver  # noqa: E402
from tests.core.test_connector_state import SIGNER  # noqa: E402
from tests.helpers import consume_transfer  # noqa: E402

L, NB, H, BS, D2 = 2, 64, 2, 16, 32          # layers, blocks, kv heads, block size, 2*head
T = 32                                        # chunk_tokens: 2 blocks
N_CHUNKS = 4


def kv_of(request: int, c: int) -> torch.Tensor:
    """What a forward computes for chunk ``c`` of request ``request``: [L, 2 blocks, H, BS, D2]."""
    g = torch.Generator().manual_seed(request * 1000 + c)
    return torch.randn((L, T // BS, H, BS, D2), generator=g)


def forward(buf: torch.Tensor, request: int, chunks: range, block_ids: list[int]) -> None:
    """The model writes the request's KV for ``chunks`` into its blocks (2 per chunk)."""
    for c in chunks:
        buf[:, block_ids[2 * c:2 * c + 2]] = kv_of(request, c)


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict


def sched_out(new=(), cached=(), resumed=(), new_blocks=(), computed=(), scheduled=None, preempted=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new), preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), resumed_req_ids=set(resumed),
                                              new_block_ids=list(new_blocks), num_computed_tokens=list(computed)),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def consume(receiver: Receiver, tid: str, got: dict) -> threading.Thread:
    receiver.expect(tid)

    def run() -> None:
        got["end"] = consume_transfer(receiver, tid, got.__setitem__, 15)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def step(sched: PrefillScheduler, worker: PushWorker, so: SimpleNamespace, buf: torch.Tensor, compute) -> None:
    """One engine step as vLLM runs it: build the metadata, handle preemptions, forward, save."""
    meta = sched.build_meta(so)
    preempted = getattr(meta, "preempted", [])
    if preempted and hasattr(worker, "preempt"):
        worker.preempt(preempted)                 # handle_preemptions: before the forward
    compute(buf)
    worker.on_step(meta.pushes, meta.finished)


def test_a_resumed_request_pushes_and_stores_only_its_own_kv():
    engine_id = f"preempt-{uuid.uuid4().hex[:6]}"
    vc = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS),
                         model_config=SimpleNamespace(model="t", max_model_len=4096),
                         parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1),
                         kv_transfer_config=SimpleNamespace(engine_id=engine_id))
    cfg = kcfg.load(overrides=[f"{k}={v}" for k, v in {
        "chunk_tokens": T, "transport.backend": "tcp", "transport.pool_bytes": "4MiB", "timeouts.peer_s": 2,
        "timeouts.heartbeat_s": 0.2, "connector.free_deadline_s": 5, "connector.helper_cpus": "inherit",
        "store.enabled": "true", "store.cpu_bytes": "8MiB"}.items()])
    buf = torch.zeros((L, NB, H, BS, D2))
    worker = PushWorker(cfg, vc)
    worker.register({f"layers.{i}.attn": buf[i] for i in range(L)})
    assert worker.layout is not None and worker.store is not None
    receiver = Receiver(cfg.transport, cfg.timeouts, make_receiver_backend(cfg.transport), worker.transfer_digest,
                        slot_bytes=HEADER_SIZE + worker.layout.chunk_bytes(T // BS), consumer_wait_s=0.5)
    sched = PrefillScheduler(cfg, StoreClient(lookup_endpoint(vc), cfg.store.lookup_timeout_s))
    tid, got = f"t-{uuid.uuid4().hex[:6]}", {}
    tokens = list(range(100, 100 + N_CHUNKS * T))
    r = Req("r", tokens, pd.params_dict(SIGNER.sign(pd.PushParams(transfer_id=tid, push_to=receiver.endpoint))))
    consumer = consume(receiver, tid, got)
    try:
        assert sched.matched(r, 0) == (0, False)                      # nothing stored yet
        first_blocks = [1, 2, 3, 4]
        new = SimpleNamespace(req_id="r", block_ids=(first_blocks,), num_computed_tokens=0, prompt_token_ids=tokens)
        step(sched, worker, sched_out(new=[new], scheduled={"r": 2 * T}), buf,
             lambda b: forward(b, 1, range(2), first_blocks))
        deadline = time.monotonic() + 10
        while len([k for k in got if isinstance(k, int)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)                                           # chunks 0 and 1 are on D
        # r is preempted: its blocks go to another request q, whose forward overwrites them
        q = SimpleNamespace(req_id="q", block_ids=(first_blocks,), num_computed_tokens=0,
                            prompt_token_ids=list(range(7, 7 + 2 * T)))
        step(sched, worker, sched_out(new=[q], scheduled={"q": 2 * T}, preempted=["r"]), buf,
             lambda b: forward(b, 2, range(2), first_blocks))
        # r resumes with a replacement block list and computes its whole prompt again
        again = list(range(20, 20 + 2 * N_CHUNKS))
        step(sched, worker, sched_out(cached=["r"], resumed=["r"], new_blocks=[(again,)], computed=[0],
                                      scheduled={"r": N_CHUNKS * T}), buf,
             lambda b: forward(b, 1, range(N_CHUNKS), again))
        assert sched.request_finished(r, again)[0]
        worker.on_step([], sched.build_meta(sched_out()).finished)
        consumer.join(20)
        _wait_settled(worker, "r")
        worker.store.store.flush()
        arrived = {c: v for c, v in got.items() if isinstance(c, int)}
        assert arrived, got
        for c, payload in arrived.items():                            # every byte D got is r's own
            assert payload == kv_of(1, c).numpy().tobytes(), f"chunk {c} pushed from another request's blocks"
        keys = chunk_keys(tokens, worker.fingerprint, T)
        for c, (_key, record) in enumerate(worker.store.store.load(keys)):
            if record is not None:                                     # every stored record is r's own
                assert bytes(read_record(record)[1]) == kv_of(1, c).numpy().tobytes(), f"store chunk {c} poisoned"
        assert isinstance(got.get("end"), TransferFailed | TransferDone)
    finally:
        worker.close()
        receiver.close()


def _wait_settled(worker: PushWorker, rid: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while rid not in done:
        assert time.monotonic() < deadline, f"{rid} never settled"
        done |= worker.take_finished()
        time.sleep(0.02)
