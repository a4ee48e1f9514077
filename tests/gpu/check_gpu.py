"""One-shot GPU check: verify and time the device paths in one run (``tests/gpu/check.sh``).

Every step is byte-compared first, then timed against the copy that bounds it, on the same
device in the same run (these machines are noisy; a ratio travels, a GB/s does not):

1. ``kernels``: the Triton gather and scatter of whole blocks against the torch reference,
   timed against a device-to-device copy of the same bytes (target >= 0.8x).
2. ``heads-nhd`` / ``heads-hnd``: the same for half of each block's heads (mixed TP's
   re-sharding) over a token-major and a head-major cache (target >= 0.8x).
3. ``pinned``: the receive pool pinned with ``cudaHostRegister``: host-to-device GB/s against
   pageable memory.
4. ``nixl``: a NIXL WRITE from a registered KV cache in device memory into a receiver's host
   pool, and into a pool in device memory (``transport.pool_device: gpu``), over the real
   transport, against a host-to-device copy of the same bytes (>= 0.5x).
5. ``workers``: the connectors' prefill and decode worker halves (``tests/gpu/halves.py``) on
   caches laid out as vLLM lays them out on GPUs (NHD, HND), equal and mixed TP (ranks as
   slices of one device), over tcp and over nixl (on a GPU: into a VRAM pool), every decode
   rank's heads against the unsplit KV.

``--device cpu`` rehearses the same script without a GPU (the Triton steps run the reference
and ``pinned`` is skipped), so the one device call is not spent on the script's own bugs.
Prints one table and writes the figures as JSON (``--json``, default ``$OUT/gpu_results.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass
class Row:
    step: str
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    ceiling: str = ""
    ratio: float = 0.0           # ceiling time / step time: 1.0 = as fast as the copy that bounds it
    target: float = 0.0          # the ratio the step must reach on a GPU (0: none)
    note: str = ""


def timed(fn: Callable[[], object], device: str, reps: int = 20) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def _d2d(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device)


def check_kernels(device: str) -> list[Row]:
    from kvrelay.kernels import cuda
    from kvrelay.kernels.blocks import gather, gather_ref, scatter
    from kvrelay.kernels.layout import KVLayout

    L, NB, H, BS, D = (32, 2048, 8, 16, 256) if device == "cuda" else (8, 256, 8, 16, 64)
    buf = torch.randn((L, NB, H, BS, D), device=device, dtype=torch.bfloat16)
    lay = KVLayout.from_caches({f"l{i}": buf[i] for i in range(L)})
    ids = torch.randperm(NB, device=device)[:16]                  # one 256-token chunk = 16 blocks
    ref = torch.empty((L, 16, lay.bytes_per_block), dtype=torch.uint8, device=device)
    got = torch.empty_like(ref)
    gather_ref(lay, ids, ref)
    gather(lay, ids, got)                                        # the Triton kernel on CUDA
    dst = buf.clone()
    dlay = KVLayout.from_caches({f"l{i}": dst[i] for i in range(L)})
    scatter(dlay, ids, got)
    ok = torch.equal(ref, got) and torch.equal(dst, buf)
    t_copy, n = _d2d(ref.numel(), device), ref.numel()
    t_g, t_s = timed(lambda: gather(lay, ids, got), device), timed(lambda: scatter(dlay, ids, got), device)
    kind = "triton" if device == "cuda" and cuda.available() else "torch reference"
    return [Row("kernels gather", ok, n, t_g, "d2d copy", t_copy / t_g, 0.8, kind),
            Row("kernels scatter", ok, n, t_s, "d2d copy", t_copy / t_s, 0.8, kind)]


def check_heads(device: str, layout: str) -> list[Row]:
    """Half of each block's heads (TP2 -> TP1's piece) gathered and scattered back."""
    from kvrelay.kernels.blocks import _byte_planes, gather_range, scatter_range
    from kvrelay.kernels.layout import KVLayout

    L, NB, H, BS, D = (32, 2048, 8, 16, 128) if device == "cuda" else (8, 256, 8, 16, 64)
    shape = (L, NB, H, BS, D) if layout == "hnd" else (L, NB, BS, H, D)
    buf = torch.randn(shape, device=device, dtype=torch.bfloat16)
    views = {f"l{i}": buf[i] if layout == "hnd" else buf[i].permute(0, 2, 1, 3) for i in range(L)}
    lay = KVLayout.from_caches(views)
    span = lay.heads_span(H // 2, H)
    ids = torch.randperm(NB, device=device)[:16]
    got = torch.empty((L, 16, span.nbytes), dtype=torch.uint8, device=device)
    gather_range(lay, ids, got, span)
    ref = torch.stack([span.of(p)[ids].reshape(16, -1) for p in _byte_planes(lay)])
    dst = buf.clone()
    dviews = {f"l{i}": dst[i] if layout == "hnd" else dst[i].permute(0, 2, 1, 3) for i in range(L)}
    dlay = KVLayout.from_caches(dviews)
    scatter_range(dlay, ids, got, span)
    ok = torch.equal(got, ref) and torch.equal(dst, buf)
    t_copy, n = _d2d(got.numel(), device), got.numel()
    t_g = timed(lambda: gather_range(lay, ids, got, span), device)
    t_s = timed(lambda: scatter_range(dlay, ids, got, span), device)
    return [Row(f"heads-{layout} gather", ok, n, t_g, "d2d copy", t_copy / t_g, 0.8, f"{span.rows} runs/block"),
            Row(f"heads-{layout} scatter", ok, n, t_s, "d2d copy", t_copy / t_s, 0.8, f"{span.rows} runs/block")]


def check_pinned(device: str) -> list[Row]:
    if device != "cuda":
        return [Row("pinned pool", True, note="skipped: no CUDA (rehearsal)")]
    from kvrelay.transport.pool import ReceivePool

    pool = ReceivePool(256 << 20, 4 << 20, shared=False)
    host = torch.frombuffer(pool.arena.buf, dtype=torch.uint8)
    pageable = torch.empty(256 << 20, dtype=torch.uint8)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    t_pin = timed(lambda: dev.copy_(host, non_blocking=True), device, 10)
    t_page = timed(lambda: dev.copy_(pageable), device, 10)
    ok = bool(pool.arena.pinned)
    pool.close()
    return [Row("pinned pool h2d", ok, 256 << 20, t_pin, "pageable h2d", t_page / t_pin, 1.0,
                "registered" if ok else "cudaHostRegister failed")]


def check_nixl(device: str) -> list[Row]:
    """A registered KV cache (VRAM on CUDA, DRAM in rehearsal) written by block ids into a host
    pool, and into a pool in device memory (transport.pool_device gpu; a tensor arena in rehearsal)."""
    return [_nixl_into(device, None), _nixl_into(device, device)]


def _nixl_into(device: str, pool_device: str | None) -> Row:
    import hashlib

    from kvrelay.common.keys import ROOT_KEY
    from kvrelay.common.wire import HEADER_SIZE, make_header
    from kvrelay.core.config import from_dict
    from kvrelay.transport.backends import make_receiver_backend, make_sender_backend
    from kvrelay.transport.backends.base import BlockPayload, MemRegion, MemType, SourceLayout
    from kvrelay.transport.events import ChunkArrival
    from kvrelay.transport.pool import Placement
    from kvrelay.transport.receiver import Receiver
    from kvrelay.transport.sender import Sender

    cfg = from_dict({"transport": {"backend": "nixl", "pool_bytes": "64MiB"}})
    fp = hashlib.sha256(b"gpu-check").digest()
    layers, blocks, block_bytes = 4, 64, 128 << 10
    cache = torch.randint(0, 255, (layers, blocks * block_bytes), dtype=torch.uint8, device=device)
    dev, mem = cache.device.index or 0, MemType.VRAM if device == "cuda" else MemType.DRAM
    layout = SourceLayout(tuple(MemRegion(cache[i].data_ptr(), cache[i].numel(), mem, dev)
                                for i in range(layers)), block_bytes)
    ids = (3, 17, 40, 63)                                         # one chunk = 4 blocks x 4 layers = 2 MiB
    host = [cache[i, b * block_bytes:(b + 1) * block_bytes].cpu().numpy().tobytes()
            for i in range(layers) for b in ids]
    key, nbytes, times, ok = ROOT_KEY[:31] + b"\x01", sum(len(h) for h in host), [], True
    with Receiver(cfg.transport, cfg.timeouts, make_receiver_backend(cfg.transport), fp,
                  slot_bytes=HEADER_SIZE + nbytes, placement=Placement(device=pool_device)) as rx, \
            Sender(cfg.transport, cfg.timeouts, rx.endpoint, make_sender_backend(cfg.transport), fp) as tx:
        tx.connect()
        tx.register_layout(layout)
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
            landed = rx.payload(ev) if isinstance(ev, ChunkArrival) else b""
            landed = landed.cpu().numpy().tobytes() if isinstance(landed, torch.Tensor) else bytes(landed)
            ok = ok and landed == b"".join(host)
            if isinstance(ev, ChunkArrival):
                rx.release(ev)
            rx.finish(tid)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t_h2d = timed(lambda: dst.copy_(src, non_blocking=True), device, 10)
    into = "a host pool" if pool_device is None else f"a {'VRAM' if device == 'cuda' else 'tensor'} pool"
    return Row(f"nixl from {'VRAM' if device == 'cuda' else 'DRAM'} into {into}", ok, nbytes, min(times), "h2d copy",
               t_h2d / min(times), 0.5, "bytes verified")


def check_workers(device: str) -> list[Row]:
    from tests.gpu.halves import Geometry, run_pair

    rows = []
    runs = [(layout, tp_p, tp_d, "tcp") for layout in ("nhd", "hnd") for tp_p, tp_d in ((1, 1), (2, 4), (4, 1))]
    # nixl (on a GPU: into a VRAM pool, pool_device auto) where each decode rank hears from one
    # prefill rank: ranks here are threads of one process, which shares one NIXL agent, and a
    # receiver knows a peer agent as one sender (vLLM runs each rank in a process of its own)
    runs += [("nhd", 2, 4, "nixl"), ("hnd", 1, 2, "nixl")]
    # on a GPU, a request of some size (2,048 tokens of an 8-layer, 8-head bf16 model: 32 MiB); the rehearsal's is tiny
    g = Geometry(layers=8, blocks=1024, kv_heads=8, block_size=16, content=128, chunk_tokens=256, prompt=2048,
                 dtype=torch.bfloat16) if device == "cuda" else None
    for layout, tp_p, tp_d, backend in runs:
        res = run_pair(layout, tp_p, tp_d, device, g, seed=tp_p * 10 + tp_d, backend=backend)
        src = torch.empty(res.bytes, dtype=torch.uint8, pin_memory=device == "cuda")
        dst = torch.empty(res.bytes, dtype=torch.uint8, device=device)
        t_h2d = timed(lambda: dst.copy_(src, non_blocking=True), device, 10)   # noqa: B023 - used at once
        rows.append(Row(f"workers {layout} P{tp_p}->D{tp_d} {backend}", res.exact, res.bytes, res.seconds, "h2d copy",
                        t_h2d / res.seconds, note="; ".join(res.mismatches[:2]) or "every decode rank's heads exact "
                        "(a whole request: control round trips included)"))
    return rows


STEPS: list[tuple[str, Callable[[str], list[Row]]]] = [
    ("kernels", check_kernels),
    ("heads-nhd", lambda d: check_heads(d, "nhd")),
    ("heads-hnd", lambda d: check_heads(d, "hnd")),
    ("pinned", check_pinned),
    ("nixl", check_nixl),
    ("workers", check_workers),
]


def table(rows: list[Row], device: str) -> str:
    gpu = device == "cuda"
    lines = [f"{'step':<28} {'ok':<4} {'MiB':>8} {'ms':>9} {'vs':<13} {'ratio':>6} {'target':>6}  note",
             "-" * 100]
    for r in rows:
        target = f"{r.target:.2f}" if r.target and gpu else "-"
        ratio = f"{r.ratio:.2f}" if r.ratio else "-"
        lines.append(f"{r.step:<28} {'PASS' if r.ok else 'FAIL':<4} {r.bytes / 2**20:>8.2f} {r.seconds * 1e3:>9.3f} "
                     f"{r.ceiling:<13} {ratio:>6} {target:>6}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu rehearses the script without a GPU (default: cuda when there is one)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "tests/gpu"), "gpu_results.json"))
    args = ap.parse_args(argv)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (rehearsal)"
    print(f"kvrelay GPU check on {name}", flush=True)
    rows: list[Row] = []
    for step, fn in STEPS:
        t0 = time.monotonic()
        try:
            rows += fn(args.device)
        except Exception as exc:  # noqa: BLE001 - report every step, then fail
            rows.append(Row(step, False, note=f"{type(exc).__name__}: {exc}"[:200]))
        print(f"  {step}: {time.monotonic() - t0:.1f} s", flush=True)
    print(table(rows, args.device))
    missed = [r.step for r in rows if args.device == "cuda" and r.target and r.ok and r.ratio < r.target]
    if missed:
        print(f"below target: {', '.join(missed)}")
    with open(args.json, "w") as f:
        json.dump({"device": name, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 1 if any(not r.ok for r in rows) or missed else 0


if __name__ == "__main__":
    sys.exit(main())
