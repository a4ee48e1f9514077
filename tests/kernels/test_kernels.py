"""Gather/scatter over engine KV caches: the torch reference against an independent per-block copy,
and the CUDA kernels against the reference (skipped without CUDA + Triton)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.chunk_records import gather_record, record_payload
from kvrelay.kernels import cuda
from kvrelay.kernels.blocks import gather, gather_into_host, gather_ref, scatter, scatter_range, scatter_ref
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span
from kvrelay.store.records import check_record, read_record
from tests.helpers import gather_to_host

L, NB, H, BS, D2 = 4, 12, 4, 128, 128        # layers, blocks, kv heads, block size, 2*head_size


def vllm_like_caches(device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """One buffer, one [num_blocks, H, block_size, 2*head] view per layer - what vLLM CPU registers."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn((L, NB, H, BS, D2), generator=g).to(torch.bfloat16).to(device)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def layout_caches(separate: bool) -> dict[str, torch.Tensor]:
    """vLLM-like caches: one buffer (a stacked layout), or each layer its own tensor (``separate``)."""
    caches = vllm_like_caches()
    return {k: v.clone() for k, v in caches.items()} if separate else caches


def expected_chunk(caches: dict[str, torch.Tensor], ids: list[int]) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in caches.values() for b in ids)


def test_layout_builds_single_strided_view():
    lay = KVLayout.from_caches(vllm_like_caches())
    assert lay.stacked is not None and lay.num_layers == L
    assert lay.bytes_per_block == H * BS * D2 * 2
    assert lay.chunk_bytes(2) == L * 2 * lay.bytes_per_block


@pytest.mark.parametrize("separate", [False, True], ids=["one-buffer", "separate-tensors"])
def test_gather_matches_per_block_bytes(separate):
    caches = layout_caches(separate)
    lay = KVLayout.from_caches(caches)
    assert (lay.stacked is None) == separate
    ids = [7, 1, 10]
    out = torch.empty((L, len(ids), lay.bytes_per_block), dtype=torch.uint8)
    gather(lay, torch.tensor(ids), out)
    assert out.numpy().tobytes() == expected_chunk(caches, ids)
    host = gather_to_host(lay, ids)
    assert host.device.type == "cpu" and host.numpy().tobytes() == expected_chunk(caches, ids)


@pytest.mark.parametrize("separate", [False, True], ids=["one-buffer", "separate-tensors"])
def test_gather_into_a_callers_buffer_and_into_a_store_record(separate):
    caches = layout_caches(separate)
    lay = KVLayout.from_caches(caches)
    ids = [3, 9, 4]
    slot = torch.full((lay.chunk_bytes(4),), 0xAB, dtype=torch.uint8)     # a reused, larger buffer
    out = gather_into_host(lay, ids, slot[:lay.chunk_bytes(3)].view(L, 3, lay.bytes_per_block))
    assert out.data_ptr() == slot.data_ptr() and out.numpy().tobytes() == expected_chunk(caches, ids)
    key = bytes(range(32))
    record = gather_record(lay, ids, key, 5)
    assert check_record(key, record) and not check_record(bytes(32), record)   # its checksum covers the payload
    hdr, payload = read_record(record)
    assert (hdr.chunk_index, hdr.num_layers, hdr.num_blocks) == (5, L, 3)
    assert bytes(payload) == expected_chunk(caches, ids)
    view = record_payload(lay, record, 3)                      # the push sends this: the record's own bytes
    assert view.numpy().tobytes() == expected_chunk(caches, ids)
    assert view.data_ptr() == torch.frombuffer(record, dtype=torch.uint8).data_ptr() + len(record) - len(payload)


@pytest.mark.parametrize("separate", [False, True], ids=["one-buffer", "separate-tensors"])
def test_scatter_roundtrip_touches_only_target_blocks(separate):
    src_caches, dst_caches = vllm_like_caches(seed=1), vllm_like_caches(seed=2)
    if separate:
        dst_caches = {k: v.clone() for k, v in dst_caches.items()}
    before = {k: v.clone() for k, v in dst_caches.items()}
    src, dst = KVLayout.from_caches(src_caches), KVLayout.from_caches(dst_caches)
    chunk = torch.empty((L, 2, src.bytes_per_block), dtype=torch.uint8)
    gather_ref(src, torch.tensor([3, 4]), chunk)
    scatter(dst, torch.tensor([9, 2]), chunk)
    for name in dst_caches:
        assert torch.equal(dst_caches[name][9], src_caches[name][3])
        assert torch.equal(dst_caches[name][2], src_caches[name][4])
        untouched = [b for b in range(NB) if b not in (9, 2)]
        assert torch.equal(dst_caches[name][untouched], before[name][untouched])


def test_layout_rejects_mismatched_layers():
    caches = vllm_like_caches()
    caches["odd"] = torch.zeros((NB, H, BS, D2 // 2), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="odd"):
        KVLayout.from_caches(caches)


def _flash_attn_caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM FlashAttention on GPU: per layer [2, num_blocks, block_size, kv_heads, head] (K, V apart)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn((L, 2, NB, 16, H, 64), generator=g).to(torch.float16)
    return {f"layers.{i}.attn": buf[i] for i in range(L)}


def _flashinfer_caches(seed: int) -> dict[str, torch.Tensor]:
    """FlashInfer: per layer [num_blocks, 2, block_size, kv_heads, head]."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn((L, NB, 2, 16, H, 64), generator=g).to(torch.float16)
    return {f"layers.{i}.attn": buf[i] for i in range(L)}


def _mla_caches(seed: int) -> dict[str, torch.Tensor]:
    """MLA: per layer [num_blocks, block_size, latent dim]."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn((NB, 16, 576), generator=g).to(torch.bfloat16) for i in range(L)}


def _block_bytes(caches: dict[str, torch.Tensor], ids: list[int]) -> bytes:
    """Independent oracle: every plane's blocks, in [plane][block] order, straight from the tensors."""
    planes = []
    for t in caches.values():
        planes += [t[0], t[1]] if t.dim() == 5 and t.shape[0] == 2 else [t]
    return b"".join(p[b].contiguous().view(torch.uint8).numpy().tobytes() for p in planes for b in ids)


@pytest.mark.parametrize("make,planes", [(_flash_attn_caches, 2 * L), (_flashinfer_caches, L), (_mla_caches, L)],
                         ids=["flash-attn-2xNB", "flashinfer-NBx2", "mla"])
def test_gpu_backend_layouts_gather_and_scatter_whole_blocks(make, planes):
    caches = make(1)
    lay = KVLayout.from_caches(caches)
    assert lay.num_layers == planes
    ids = [6, 0, 11]
    assert gather_to_host(lay, ids).numpy().tobytes() == _block_bytes(caches, ids)
    dst = make(2)
    before = {k: v.clone() for k, v in dst.items()}
    scatter(KVLayout.from_caches(dst), torch.tensor([2, 9, 4]), gather_to_host(lay, ids))
    assert _block_bytes(dst, [2, 9, 4]) == _block_bytes(caches, ids)
    others = [b for b in range(NB) if b not in (2, 9, 4)]
    assert _block_bytes(dst, others) == _block_bytes(before, others)


def test_dispatch_falls_back_to_the_reference_for_layouts_the_kernel_cannot_take(monkeypatch):
    """A CUDA-resident layout without one strided view must not reach the kernel."""
    from kvrelay.kernels import blocks

    lay = KVLayout.from_caches({k: v.clone() for k, v in vllm_like_caches().items()})
    assert lay.stacked is None
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(type(lay), "device", property(lambda self: torch.device("cuda")))
    assert not blocks._fast_path(lay)


needs_cuda = pytest.mark.skipif(not cuda.available(), reason="needs CUDA and Triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_into_a_host_buffer_from_a_device_cache():
    caches = vllm_like_caches("cuda")
    lay = KVLayout.from_caches(caches)
    ids = [2, 8, 5]
    out = torch.zeros((L, len(ids), lay.bytes_per_block), dtype=torch.uint8)      # host, reused by the push
    assert gather_into_host(lay, ids, out) is out and out.device.type == "cpu"
    assert out.numpy().tobytes() == expected_chunk({k: v.cpu() for k, v in caches.items()}, ids)


@needs_cuda
def test_cuda_gather_scatter_match_reference():
    caches = vllm_like_caches("cuda")
    lay = KVLayout.from_caches(caches)
    ids = torch.tensor([5, 0, 11, 3], device="cuda")
    ref = torch.empty((L, 4, lay.bytes_per_block), dtype=torch.uint8, device="cuda")
    got = torch.empty_like(ref)
    gather_ref(lay, ids, ref)
    cuda.gather(lay, ids, got)
    assert torch.equal(ref, got)
    dst_ref, dst_got = vllm_like_caches("cuda", 3), vllm_like_caches("cuda", 3)
    scatter_ref(KVLayout.from_caches(dst_ref), ids, got)
    cuda.scatter(KVLayout.from_caches(dst_got), ids, got)
    for k in dst_ref:
        assert torch.equal(dst_ref[k], dst_got[k])


@pytest.mark.parametrize("separate", [False, True], ids=["stacked", "per-layer"])
def test_scatter_in_runs_of_consecutive_blocks_matches_per_block_copies(separate):
    """The CPU scatter copies each run of consecutive block ids in one slice; every block must
    still land where a block-by-block copy would put it, and no other block may change."""
    from kvrelay.kernels.blocks import _runs

    ids = [5, 6, 7, 1, 10, 11]
    assert _runs(ids) == [(0, 5, 3), (3, 1, 1), (4, 10, 2)] and _runs([]) == []
    src_caches, dst_caches = vllm_like_caches(seed=3), vllm_like_caches(seed=4)
    if separate:
        dst_caches = {k: v.clone() for k, v in dst_caches.items()}
    before = {k: v.clone() for k, v in dst_caches.items()}
    src, dst = KVLayout.from_caches(src_caches), KVLayout.from_caches(dst_caches)
    chunk = gather_to_host(src, [0, 2, 4, 6, 8, 9])
    scatter(dst, torch.tensor(ids), chunk)
    for name in dst_caches:
        for j, b in enumerate(ids):
            assert torch.equal(dst_caches[name][b], src_caches[name][[0, 2, 4, 6, 8, 9][j]])
        untouched = [b for b in range(NB) if b not in ids]
        assert torch.equal(dst_caches[name][untouched], before[name][untouched])


# ------------------------------------------------------------------ head ranges (mixed TP)
def _logical_caches(layout: str, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM >= 0.32: per layer a logical [NB, H, N, C] view; ``hnd`` head-major in memory (the
    CPU backend, LBHNC), ``nhd`` token-major (FlashAttention/FlashInfer's LBNHC)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "hnd":
        buf = torch.randn((L, NB, H, 16, 64), generator=g).to(torch.float16).to(device)
        return {f"layers.{i}.attn": buf[i] for i in range(L)}
    buf = torch.randn((L, NB, 16, H, 64), generator=g).to(torch.float16).to(device)
    return {f"layers.{i}.attn": buf[i].permute(0, 2, 1, 3) for i in range(L)}


def _heads_span(lay: KVLayout, h0: int, h1: int) -> Span:
    """Heads [h0, h1) of a block, from where the layout says its heads sit."""
    assert lay.heads_dim is not None and lay.block_shape()[lay.heads_dim] == H
    return lay.heads_span(h0, h1)


def _heads_bytes(caches: dict[str, torch.Tensor], ids: list[int], h0: int, h1: int, layout: str) -> bytes:
    """Independent oracle: heads [h0, h1) of each block from the logical views, in memory order."""
    out = []
    for t in caches.values():
        for b in ids:
            heads = t[b, h0:h1]                                           # [h, N, C] logical
            out.append((heads if layout == "hnd" else heads.transpose(0, 1)).contiguous().view(torch.uint8))
    return b"".join(x.cpu().numpy().tobytes() for x in out)


@pytest.mark.parametrize("separate", [False, True], ids=["one-buffer", "separate-tensors"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_head_range_gather_and_scatter_match_the_logical_heads(layout, separate):
    caches = _logical_caches(layout, seed=5)
    if separate:
        caches = {k: v.clone() if layout == "hnd" else v.permute(0, 2, 1, 3).clone().permute(0, 2, 1, 3)
                  for k, v in caches.items()}
    lay = KVLayout.from_caches(caches)
    assert (lay.stacked is None) == separate and lay.heads_dim == (0 if layout == "hnd" else 1)
    span, ids = _heads_span(lay, 1, 3), [7, 1, 10]
    out = torch.empty((L, len(ids), span.nbytes), dtype=torch.uint8)
    gather_into_host(lay, ids, out, span)
    assert out.numpy().tobytes() == _heads_bytes(caches, ids, 1, 3, layout)
    dst = _logical_caches(layout, seed=6)
    before = {k: v.clone() for k, v in dst.items()}
    scatter_range(KVLayout.from_caches(dst), torch.tensor([2, 3, 9]), out, span)
    assert _heads_bytes(dst, [2, 3, 9], 1, 3, layout) == _heads_bytes(caches, ids, 1, 3, layout)
    for h0, h1 in ((0, 1), (3, 4)):                     # the other heads of those blocks are untouched
        assert _heads_bytes(dst, [2, 3, 9], h0, h1, layout) == _heads_bytes(before, [2, 3, 9], h0, h1, layout)


@needs_cuda
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_cuda_head_range_gather_scatter_match_reference(layout):
    from kvrelay.kernels.blocks import _byte_planes

    caches = _logical_caches(layout, "cuda", seed=7)
    lay = KVLayout.from_caches(caches)
    span, ids = _heads_span(lay, 1, 3), torch.tensor([5, 0, 11, 3], device="cuda")
    got = torch.empty((L, 4, span.nbytes), dtype=torch.uint8, device="cuda")
    cuda.gather(lay, ids, got, span)
    ref = torch.stack([span.of(p)[ids].reshape(4, -1) for p in _byte_planes(lay)])
    assert torch.equal(got, ref)
    dst = _logical_caches(layout, "cuda", seed=8)
    want = {k: v.clone() for k, v in dst.items()}
    for i, p in enumerate(_byte_planes(KVLayout.from_caches(want))):
        span.of(p)[ids] = got[i].view(4, span.rows, span.width)
    cuda.scatter(KVLayout.from_caches(dst), ids, got, span)
    for k in dst:
        assert torch.equal(dst[k], want[k])
