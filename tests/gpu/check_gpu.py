"""One-shot GPU check: build, verify and time the CUDA paths (run by tests/gpu/check.sh).

1. Triton gather/scatter vs the torch reference (bit-exact), then GB/s vs a same-size
   device-to-device copy (target >= 0.8x).
2. The receive pool pinned with cudaHostRegister: H2D copy GB/s from it vs pageable memory.
3. NIXL on VRAM: a sender writes a chunk from GPU memory into a receiver's host pool over
   the real transport; bytes verified.
Prints a table and writes tests/gpu/results.json (or $OUT/gpu_results.json).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def check_kernels(results: dict) -> None:
    from kvrelay.kernels import cuda
    from kvrelay.kernels.blocks import gather_ref
    from kvrelay.kernels.layout import KVLayout

    L, NB, H, BS, D = 32, 4096, 8, 16, 256          # a Llama-8B-like GPU cache, block 16
    buf = torch.randn((L, NB, H, BS, D), device="cuda", dtype=torch.bfloat16)
    lay = KVLayout.from_caches({f"l{i}": buf[i] for i in range(L)})
    ids = torch.randperm(NB, device="cuda")[:16]     # one 256-token chunk = 16 blocks
    ref = torch.empty((L, 16, lay.bytes_per_block), dtype=torch.uint8, device="cuda")
    got = torch.empty_like(ref)
    gather_ref(lay, ids, ref)
    cuda.gather(lay, ids, got)
    assert torch.equal(ref, got), "triton gather != reference"
    dst = buf.clone()
    dlay = KVLayout.from_caches({f"l{i}": dst[i] for i in range(L)})
    cuda.scatter(dlay, ids, got)
    assert torch.equal(dst, buf), "scatter of gathered blocks must restore them"
    nbytes = ref.numel()
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    t_copy = timed(lambda: flat_dst.copy_(flat_src))
    t_g = timed(lambda: cuda.gather(lay, ids, got))
    t_s = timed(lambda: cuda.scatter(dlay, ids, got))
    t_ref = timed(lambda: gather_ref(lay, ids, ref))
    results["kernels"] = {"chunk_bytes": nbytes, "d2d_GBps": nbytes / t_copy / 1e9,
                          "gather_GBps": nbytes / t_g / 1e9, "scatter_GBps": nbytes / t_s / 1e9,
                          "torch_ref_gather_GBps": nbytes / t_ref / 1e9,
                          "gather_vs_d2d": t_copy / t_g, "scatter_vs_d2d": t_copy / t_s}


def check_pinned(results: dict) -> None:
    from kvrelay.transport.pool import ReceivePool

    pool = ReceivePool(256 << 20, 4 << 20, shared=False)
    pinned = pool.arena.pinned                 # ReceivePool pins at construction
    host = torch.frombuffer(pool.arena.buf, dtype=torch.uint8)
    pageable = torch.empty(256 << 20, dtype=torch.uint8)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    t_pin = timed(lambda: dev.copy_(host, non_blocking=True), 10)
    t_page = timed(lambda: dev.copy_(pageable), 10)
    results["pinned_pool"] = {"registered": bool(pinned), "h2d_pinned_GBps": (256 << 20) / t_pin / 1e9,
                              "h2d_pageable_GBps": (256 << 20) / t_page / 1e9}
    pool.close()


def check_nixl_vram(results: dict, device: str = "cuda") -> None:
    """A registered VRAM layout (``MemRegion(..., MemType.VRAM)``) written by block ids.
    ``device="cpu"`` runs the same path from DRAM (a self-test of this check without a GPU)."""
    import hashlib

    from kvrelay.common.keys import ROOT_KEY
    from kvrelay.common.wire import HEADER_SIZE, make_header
    from kvrelay.core.config import from_dict
    from kvrelay.transport.backends import make_receiver_backend, make_sender_backend
    from kvrelay.transport.backends.base import BlockPayload, MemRegion, MemType, SourceLayout
    from kvrelay.transport.events import ChunkArrival
    from kvrelay.transport.receiver import Receiver
    from kvrelay.transport.sender import Sender

    cfg = from_dict({"transport": {"backend": "nixl", "pool_bytes": "64MiB"}})
    fp = hashlib.sha256(b"gpu-check").digest()
    layers, blocks, block_bytes = 4, 64, 128 << 10            # [L=4][NB=64] x 128 KiB in VRAM
    cache = torch.randint(0, 255, (layers, blocks * block_bytes), dtype=torch.uint8, device=device)
    dev, mem = cache.device.index or 0, MemType.VRAM if device == "cuda" else MemType.DRAM
    layout = SourceLayout(tuple(MemRegion(cache[i].data_ptr(), cache[i].numel(), mem, dev)
                                for i in range(layers)), block_bytes)
    ids = (3, 17, 40, 63)                                        # one chunk = 4 blocks x 4 layers = 2 MiB
    host = [cache[i, b * block_bytes:(b + 1) * block_bytes].cpu().numpy().tobytes()
            for i in range(layers) for b in ids]                 # [layer][block] order, as written
    key = ROOT_KEY[:31] + b"\x01"
    nbytes = sum(len(h) for h in host)
    with Receiver(cfg.transport, cfg.timeouts, make_receiver_backend(cfg.transport), fp,
                  slot_bytes=HEADER_SIZE + nbytes) as rx, \
            Sender(cfg.transport, cfg.timeouts, rx.endpoint, make_sender_backend(cfg.transport), fp) as tx:
        tx.connect()
        tx.register_layout(layout)
        times = []
        for rep in range(5):
            tid = f"gpu{rep}"
            rx.expect(tid)
            header = make_header(key, tid, 0, host, num_layers=layers, num_blocks=len(ids)).pack()
            alloc = tx.alloc(tid, [key], [HEADER_SIZE + nbytes])
            t0 = time.perf_counter()
            h = tx.write_chunk(alloc, 0, BlockPayload(ids), header=header)
            assert h is not None
            tx.wait(h)
            ev = rx.next_event(tid, 10)
            times.append(time.perf_counter() - t0)
            assert isinstance(ev, ChunkArrival), ev
            assert bytes(rx.payload(ev)) == b"".join(host), "VRAM -> host pool bytes differ"
            rx.release(ev)
            rx.finish(tid)
    best = min(times)
    results["nixl_vram"] = {"bytes": nbytes, "best_seconds": best, "GBps": nbytes / best / 1e9,
                            "reps": len(times), "verified": "bytes equal the VRAM source"}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    results: dict = {"device": torch.cuda.get_device_name()}
    failures = []
    for name, fn in [("kernels", check_kernels), ("pinned", check_pinned), ("nixl_vram", check_nixl_vram)]:
        try:
            fn(results)
            print(f"PASS {name}: {json.dumps(results.get(name, results.get('pinned_pool')))}")
        except Exception as exc:  # noqa: BLE001 - report every check
            failures.append(name)
            print(f"FAIL {name}: {exc!r}")
    out = os.path.join(os.environ.get("OUT", "tests/gpu"), "gpu_results.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
