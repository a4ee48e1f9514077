"""The connectors' worker halves on KV caches laid out as vLLM lays them out, without vLLM.

vLLM (>= 0.32) hands a connector every layer as a logical ``[blocks, kv_heads, block_size,
content]`` view whose strides give the physical order: head-major (HND, ``LBHNC``: the CPU
backend, FlashInfer HND) or token-major (NHD, ``LBNHC``: FlashAttention, FlashInfer's default).
The thin adapter here is the ``vllm_config`` a worker reads (block size, model, TP rank and
size, KV heads) and the caches it registers; everything else is the real code: the
:class:`PushWorker` ranks of a prefill node gather and push over a real transport (tcp) into
the real :class:`InstallWorker` ranks of a decode node, which scatter into their caches.

:func:`run_pair` returns what each decode rank holds against its heads of the unsplit KV, and
the time from the first push to the last install. The CPU tests (``tests/core/test_mixed_tp_layouts.py``)
and the GPU check (``tests/gpu/check_gpu.py``, on CUDA caches) both run it.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvrelay.core import config as kcfg
from kvrelay.core.ranks import Sharding
from kvrelay.decode.installer import InstallWorker
from kvrelay.decode.specs import LoadSpec
from kvrelay.prefill.pusher import PushWorker
from kvrelay.prefill.specs import PushSpec


@dataclass(frozen=True)
class Geometry:
    layers: int = 2
    blocks: int = 32
    kv_heads: int = 4
    block_size: int = 16
    content: int = 16            # the last dimension of vLLM's [B, H, N, C] view
    chunk_tokens: int = 32
    prompt: int = 80             # 3 chunks, the last partial
    dtype: torch.dtype = torch.float32

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt // self.block_size)


@dataclass(frozen=True)
class PairResult:
    exact: bool
    mismatches: list[str]
    seconds: float
    bytes: int                   # KV bytes of the prompt (every layer, every head)


def free_port_base(span: int = 16) -> int:
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


def caches(g: Geometry, layout: str, local_heads: int, device: str) -> dict[str, torch.Tensor]:
    """One rank's KV caches as vLLM hands them over: logical [blocks, heads, N, C] per layer, in
    ``layout``'s physical order (hnd: heads outside tokens; nhd: tokens outside heads)."""
    if layout == "hnd":
        buf = torch.zeros((g.layers, g.blocks, local_heads, g.block_size, g.content), dtype=g.dtype, device=device)
        return {f"layers.{i}.attn": buf[i] for i in range(g.layers)}
    buf = torch.zeros((g.layers, g.blocks, g.block_size, local_heads, g.content), dtype=g.dtype, device=device)
    return {f"layers.{i}.attn": buf[i].permute(0, 2, 1, 3) for i in range(g.layers)}


def vllm_config(g: Geometry, tp: int, rank: int, engine_id: str) -> SimpleNamespace:
    """The adapter: what the worker halves read of vLLM's config."""
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=g.block_size),
                           model_config=SimpleNamespace(model="t", max_model_len=4096,
                                                        get_total_num_kv_heads=lambda: g.kv_heads),
                           parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=tp),
                           kv_transfer_config=SimpleNamespace(engine_id=engine_id))


def relay_config(g: Geometry, tp_p: int, tp_d: int, port: int, backend: str = "tcp") -> kcfg.KVRelayConfig:
    return kcfg.load(overrides=[f"{k}={v}" for k, v in {
        "chunk_tokens": g.chunk_tokens, "transport.backend": backend, "transport.control_port": port,
        "transport.pool_bytes": "64MiB", "engine.prefill_tp": tp_p, "engine.decode_tp": tp_d, "timeouts.peer_s": 5,
        "connector.free_deadline_s": 10, "connector.helper_cpus": "inherit"}.items()])


def run_pair(layout: str, tp_p: int, tp_d: int, device: str = "cpu", g: Geometry | None = None,
             seed: int = 0, backend: str = "tcp") -> PairResult:
    """Prefill ranks at TP ``tp_p`` push one prompt's KV to decode ranks at TP ``tp_d``, caches on
    ``device`` in ``layout``, over ``backend`` (nixl on a GPU: into a receive pool in device
    memory, transport.pool_device auto); every decode rank's heads are compared with the unsplit KV."""
    g = g or Geometry()
    cfg, run = relay_config(g, tp_p, tp_d, free_port_base(), backend), uuid.uuid4().hex[:6]
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn((g.layers, g.prompt_blocks, g.kv_heads, g.block_size, g.content), generator=gen).to(g.dtype)
    full = full.to(device)                                          # [L, n, H, N, C] logical
    p_ids = [3 + 5 * i for i in range(g.prompt_blocks)]
    d_ids = [g.blocks - 1 - 3 * i for i in range(g.prompt_blocks)]
    tokens, tid = list(range(500, 500 + g.prompt)), f"halves-{layout}-{run}"
    decode = [InstallWorker(cfg, vllm_config(g, tp_d, r, f"d-{run}")) for r in range(tp_d)]
    prefill = [PushWorker(cfg, vllm_config(g, tp_p, r, f"p-{run}")) for r in range(tp_p)]
    try:
        held = _register(g, layout, decode, prefill, full, p_ids, device)
        t0 = time.perf_counter()
        for w in decode:
            w.start([LoadSpec("r", tid, tokens, d_ids, 0, g.prompt)], [], [])
        endpoint = decode[0].receiver.endpoint
        for w in prefill:
            w.on_step([PushSpec("r", tid, endpoint, g.prompt, p_ids, g.prompt, token_ids=tokens)], [])
            w.on_step([], ["r"])
        bad = []
        for r, w in enumerate(decode):
            wait_finished(w, "r")
            if w.take_errors():
                bad.append(f"decode rank {r} reported blocks to recompute")
        seconds = time.perf_counter() - t0
        bad += _compare(g, held, full, d_ids, tp_d)
        for w in prefill:
            wait_finished(w, "r")
        return PairResult(not bad, bad, seconds, full.numel() * full.element_size())
    finally:
        for w in prefill + decode:
            w.close()
            receiver = getattr(w, "receiver", None)
            if receiver is not None:
                receiver.close()


def _register(g: Geometry, layout: str, decode: list[InstallWorker], prefill: list[PushWorker],
              full: torch.Tensor, p_ids: list[int], device: str) -> list[dict[str, torch.Tensor]]:
    """Register every rank's caches; the prefill ranks' hold their heads of ``full`` (the forward)."""
    held = []
    for w in decode:
        held.append(caches(g, layout, g.kv_heads // len(decode), device))
        w.register(held[-1])
    for r, w in enumerate(prefill):
        mine = caches(g, layout, g.kv_heads // len(prefill), device)
        h = Sharding(g.kv_heads, len(prefill)).heads(r)
        for i, kv in enumerate(mine.values()):
            kv[p_ids] = full[i][:, h.start:h.stop]
        w.register(mine)
    if len({w.transfer_digest for w in [*decode, *prefill]}) != 1:
        raise AssertionError("the ranks do not agree on the transfer (fingerprints differ)")
    return held


def _compare(g: Geometry, held: list[dict[str, torch.Tensor]], full: torch.Tensor, d_ids: list[int],
             tp_d: int) -> list[str]:
    bad = []
    for r, rank_caches in enumerate(held):
        h = Sharding(g.kv_heads, tp_d).heads(r)
        for i, kv in enumerate(rank_caches.values()):
            if not torch.equal(kv[d_ids], full[i][:, h.start:h.stop]):
                bad.append(f"decode rank {r}, layer {i}: heads {h.start}-{h.stop - 1} differ from the unsplit KV")
    return bad


def wait_finished(worker: PushWorker | InstallWorker, rid: str, timeout: float = 30) -> None:
    deadline, done = time.monotonic() + timeout, set[str]()
    while rid not in done:
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid} never settled on {type(worker).__name__}")
        done |= worker.take_finished()
        time.sleep(0.005)
