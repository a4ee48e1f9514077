"""The prefill scheduler's store lookup over real ZeroMQ: a stored prefix is found in whole
chunks (always leaving a token to compute), and a worker that does not answer in
``store.lookup_timeout_s`` is a miss the client recovers from."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import msgspec
import zmq

from kvrelay.common.keys import Fingerprint, chunk_keys
from kvrelay.core import config as kcfg
from kvrelay.core.telemetry import EventLog
from kvrelay.prefill.lookup import Lookup, LookupReply, StoreClient, lookup_endpoint
from kvrelay.prefill.store_service import StoreService
from tests.helpers import make_record

FP = Fingerprint("tiny", "float32", "cpu", 16, 4, 8192)
T = 256


def record(key, c, gathered):
    return make_record(key, c, gathered.numpy().data, num_layers=gathered.shape[0], num_blocks=gathered.shape[1])


def _vllm_config() -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=f"t-{uuid.uuid4().hex[:8]}"),
                           cache_config=SimpleNamespace(block_size=16))


def test_lookup_finds_the_stored_prefix_in_whole_chunks():
    import torch

    cfg = kcfg.from_dict({"store": {"enabled": True, "cpu_bytes": "16MiB"}})
    vc = _vllm_config()
    svc = StoreService(cfg, vc, EventLog("", "prefill-test"))
    svc.bind(None, FP)  # type: ignore[arg-type]  # lookups need only the fingerprint
    client = StoreClient(lookup_endpoint(vc), cfg.store.lookup_timeout_s)
    try:
        tokens = list(range(7, 7 + 3 * T))                        # exactly 3 chunks
        keys = chunk_keys(tokens, FP, T)
        gathered = torch.zeros(4, T // 16, 64, dtype=torch.uint8)
        assert client.lookup(tokens) == 0                           # nothing stored yet
        for c in (0, 2):
            svc.store.put(keys[c], record(keys[c], c, gathered))
        assert client.lookup(tokens + [5]) == T                     # a hole (chunk 1) ends the prefix
        svc.store.put(keys[1], record(keys[1], 1, gathered))
        assert client.lookup(tokens) == 2 * T                       # the last token is always computed
        assert client.lookup(tokens + [5]) == 3 * T
        assert client.lookup([99] + tokens[1:]) == 0                # chained keys: a new first token misses all
    finally:
        svc.close()


def test_a_silent_worker_is_a_miss_after_the_timeout_and_the_client_recovers(tmp_path):
    endpoint = f"ipc://{tmp_path}/lookup.sock"
    rep: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(endpoint)
    client = StoreClient(endpoint, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert client.lookup([1, 2, 3]) == 0                        # nobody answers
        assert 0.25 <= time.monotonic() - t0 < 2.0
        assert rep.poll(1000)
        rep.recv()                                                  # the stale request...
        rep.send(msgspec.msgpack.encode(LookupReply(999)))          # ...answered too late: dropped

        def answer() -> None:
            req = msgspec.msgpack.decode(rep.recv(), type=Lookup)
            rep.send(msgspec.msgpack.encode(LookupReply(len(req.token_ids))))

        t = threading.Thread(target=answer)
        t.start()
        assert client.lookup(list(range(512))) == 512               # a fresh socket, the right reply
        t.join(5)
    finally:
        rep.close(linger=0)
