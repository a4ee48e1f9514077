"""Mixed TP over the GPU block layouts, through the real worker halves on CPU tensors.

vLLM (>= 0.32) hands a connector every layer as a logical ``[blocks, kv_heads, block_size,
content]`` view; the physical order is in the strides. Its CPU backend is head-major (HND:
``LBHNC``); FlashAttention and FlashInfer on GPUs may be token-major (NHD: ``LBNHC``), where a
block holds every head of one token before the next token. Here each rank's cache is a CPU
tensor laid out and strided exactly so, and the real :class:`PushWorker` ranks of a prefill node
push over a real tcp transport into the real :class:`InstallWorker` ranks of a decode node at
another TP size. What each decode rank holds afterwards is compared, byte for byte, with its
heads of the unsplit KV the prefill ranks were given.
"""

from __future__ import annotations

import socket
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core.ranks import Sharding  # noqa: E402
from kvrelay.decode.installer import InstallWorker  # noqa: E402
from kvrelay.decode.messages import LoadSpec  # noqa: E402
from kvrelay.prefill.messages import PushSpec  # noqa: E402
from kvrelay.prefill.pusher import PushWorker  # noqa: E402

L, NB, H, BS, C = 2, 32, 4, 16, 16          # layers, blocks, KV heads, block size, content (float32)
T, PROMPT = 32, 80                          # chunk_tokens (2 blocks), prompt (3 chunks, the last partial)
N_BLOCKS = -(-PROMPT // BS)


def _free_port_base(span: int = 8) -> int:
    """A base port with ``span`` free ports above it (decode rank r listens on base + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span < 65000 and all(_free(base + k) for k in range(span)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _caches(layout: str, local_heads: int) -> dict[str, torch.Tensor]:
    """One rank's KV caches as vLLM hands them over: logical [NB, heads, BS, C] per layer, in
    ``layout``'s physical order (hnd: heads outside tokens; nhd: tokens outside heads)."""
    if layout == "hnd":
        buf = torch.zeros((L, NB, local_heads, BS, C))
        return {f"layers.{i}.attn": buf[i] for i in range(L)}
    buf = torch.zeros((L, NB, BS, local_heads, C))
    return {f"layers.{i}.attn": buf[i].permute(0, 2, 1, 3) for i in range(L)}


def _vllm_config(tp: int, rank: int, engine_id: str) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=BS),
                           model_config=SimpleNamespace(model="t", max_model_len=4096,
                                                        get_total_num_kv_heads=lambda: H),
                           parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=tp),
                           kv_transfer_config=SimpleNamespace(engine_id=engine_id))


def _cfg(tp_p: int, tp_d: int, port: int) -> kcfg.KVRelayConfig:
    return kcfg.load(overrides=[f"{k}={v}" for k, v in {
        "chunk_tokens": T, "transport.backend": "tcp", "transport.control_port": port, "transport.pool_bytes": "8MiB",
        "engine.prefill_tp": tp_p, "engine.decode_tp": tp_d, "timeouts.peer_s": 5, "connector.free_deadline_s": 10,
        "connector.helper_cpus": "inherit"}.items()])


def _heads(kv: torch.Tensor, ids: list[int], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s heads of blocks ``ids`` of one layer's logical view: [n, heads, BS, C]."""
    h = Sharding(H, tp).heads(rank)
    return kv[ids][:, h.start:h.stop] if kv.shape[1] == H else kv[ids]


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 4), (4, 1)], ids=["p2-d4", "p4-d1"])
def test_mixed_tp_over_gpu_block_layouts_is_byte_exact(layout: str, tp_p: int, tp_d: int) -> None:
    cfg, run = _cfg(tp_p, tp_d, _free_port_base()), uuid.uuid4().hex[:6]
    full = torch.randn((L, N_BLOCKS, H, BS, C), generator=torch.Generator().manual_seed(tp_p * 10 + tp_d))
    p_ids, d_ids = [3, 9, 4, 20, 5][:N_BLOCKS], [30, 1, 17, 2, 8][:N_BLOCKS]
    tokens, tid = list(range(500, 500 + PROMPT)), f"mixed-{layout}-{run}"
    decode = [InstallWorker(cfg, _vllm_config(tp_d, r, f"d-{run}")) for r in range(tp_d)]
    prefill = [PushWorker(cfg, _vllm_config(tp_p, r, f"p-{run}")) for r in range(tp_p)]
    try:
        d_caches = []
        for r, w in enumerate(decode):
            d_caches.append(_caches(layout, H // tp_d))
            w.register(d_caches[r])
        for r, w in enumerate(prefill):
            caches = _caches(layout, H // tp_p)
            for i, kv in enumerate(caches.values()):           # the forward: this rank's heads of the prompt
                h = Sharding(H, tp_p).heads(r)
                kv[p_ids] = full[i][:, h.start:h.stop]
            w.register(caches)
        assert len({w.transfer_digest for w in decode + prefill}) == 1, "the ranks must agree on the transfer"
        for w in decode:
            w.start([LoadSpec("r", tid, tokens, d_ids, 0, PROMPT)], [], [])
        endpoint = decode[0].receiver.endpoint
        for w in prefill:
            w.on_step([PushSpec("r", tid, endpoint, PROMPT, p_ids, PROMPT, token_ids=tokens)], [])
            w.on_step([], ["r"])
        for r, w in enumerate(decode):
            _wait_finished(w, "r")
            assert not w.take_errors(), f"decode rank {r} reported blocks to recompute"
            for i, kv in enumerate(d_caches[r].values()):
                want = full[i][:, Sharding(H, tp_d).heads(r).start:Sharding(H, tp_d).heads(r).stop]
                assert torch.equal(kv[d_ids], want), f"decode rank {r}, layer {i}: heads differ from the unsplit KV"
        for w in prefill:
            _wait_finished(w, "r")
    finally:
        for w in prefill + decode:
            w.close()
            receiver = getattr(w, "receiver", None)
            if receiver is not None:
                receiver.close()


def _wait_finished(worker: PushWorker | InstallWorker, rid: str, timeout: float = 20) -> None:
    deadline, done = time.monotonic() + timeout, set[str]()
    while rid not in done:
        assert time.monotonic() < deadline, f"{rid} never settled on {type(worker).__name__}"
        done |= worker.take_finished()
        time.sleep(0.02)
