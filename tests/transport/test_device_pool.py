"""A receive pool in device memory (``transport.pool_device``), as far as a host without a GPU allows.

The pool's arena is a torch tensor on the decode engine's KV-cache device; NIXL registers it
(VRAM on a GPU) and prefill nodes write chunks straight into it; each chunk's header, which
NIXL delivers in the write's notification, is kept on the host beside it; the install is a
device-to-device scatter whose installed bytes are hashed. Here the arena is a CPU tensor, so
every one of those code paths runs, with NIXL's DRAM standing in for VRAM; the GPU check
(``tests/gpu/check.sh``) runs the same on a GPU.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvrelay.common.errors import ChecksumError, ConfigError, TransportError
from kvrelay.common.wire import HEADER_SIZE, make_header
from kvrelay.core import config as kcfg
from kvrelay.decode.install import install_verified
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span
from kvrelay.transport.events import ChunkArrival, TransferDone
from kvrelay.transport.pool import Placement, ReceivePool, SlotRef
from tests.transport.conftest import assert_no_leases, keys_for, make_cfg, make_receiver, open_pair

ON_DEVICE = Placement(device="cpu")        # a tensor arena: the device pool's code paths, without a GPU


def test_the_setting_picks_device_memory_only_where_the_backend_can_write_it():
    with pytest.raises(ConfigError, match="pool_device gpu needs one-sided writes"):
        kcfg.load(overrides=["transport.backend=tcp", "transport.pool_device=gpu"])
    nixl, tcp = kcfg.load(overrides=["transport.backend=nixl"]).transport, kcfg.load(overrides=["transport.backend=tcp"]).transport
    assert nixl.pool_on("cuda:1", writes_device=True) == "cuda:1"             # auto, on a GPU engine
    assert nixl.pool_on("cpu", writes_device=True) is None                   # auto, on a CPU engine
    assert tcp.pool_on("cuda:0", writes_device=False) is None                # auto, a backend that cannot
    host = kcfg.load(overrides=["transport.backend=nixl", "transport.pool_device=host"]).transport
    assert host.pool_on("cuda:0", writes_device=True) is None
    gpu = kcfg.load(overrides=["transport.backend=nixl", "transport.pool_device=gpu"]).transport
    with pytest.raises(ConfigError, match="KV cache is on cpu"):
        gpu.pool_on("cpu", writes_device=True)


@pytest.mark.parametrize("backend", ["tcp", "shm", "ucx"])
def test_backends_that_cannot_write_device_memory_refuse_such_a_pool(backend):
    with pytest.raises(TransportError, match="cannot write a pool in device memory"):
        make_receiver(make_cfg(backend), placement=ON_DEVICE)


def test_a_device_pool_keeps_headers_on_the_host_and_hands_out_tensors():
    pool = ReceivePool(4 << 20, 1 << 20, shared=False, placement=ON_DEVICE)
    ref = pool.allocate(1, "t", 1.0)[0]
    pool.header_view(ref)[:4] = b"KVRC"
    assert bytes(pool.header_view(ref)[:4]) == b"KVRC" and not pool.arena.tensor[:4].any()
    pay = pool.payload(ref, 100)
    assert isinstance(pay, torch.Tensor) and pay.numel() == 100
    assert pay.data_ptr() == pool.arena.address + pool.offset(ref) + HEADER_SIZE
    with pytest.raises(TransportError, match="no host view"):
        pool.view(ref)
    pool.close()


def _digest(payload) -> str:
    return hashlib.sha256(payload.cpu().numpy().tobytes()).hexdigest()


def test_nixl_writes_land_in_a_device_pool_byte_identical_and_are_left_to_the_consumer_to_verify():
    with open_pair(make_cfg("nixl"), placement=ON_DEVICE) as (receiver, peer):
        assert receiver.pool.on_device
        sizes, block = [4093, 65536, 300_001], 16384
        peer.call("prepare", "src", sum(sizes), 7)
        peer.call("prepare", "kv", 4 * block, 9, block)
        tid, want = "dev", {}
        peer.call("alloc", tid, keys_for(tid, 4), [HEADER_SIZE + n for n in sizes] + [HEADER_SIZE + 2 * block])
        for i, n in enumerate(sizes):                                # plain buffers, 1..3 regions each
            want[i] = peer.call("digest", "src", sum(sizes[:i]), n)
            peer.call("write", tid, i, "src", sum(sizes[:i]), n, 1 + i % 3)
        want[3] = peer.call("digest", "kv", 2 * block, 2 * block)   # named blocks of a registered layout
        peer.call("write", tid, 3, "kv", 2 * block, 2 * block, 1, False, True, True)
        got = {}
        while True:
            ev = receiver.next_event(tid, 10)
            if isinstance(ev, ChunkArrival):
                assert not ev.verified                              # the consumer hashes what it installs
                got[ev.chunk_index] = _digest(receiver.payload(ev))
                receiver.release(ev)
            if isinstance(ev, TransferDone):
                break
        receiver.finish(tid)
        assert got == want
        time.sleep(0.05)
        assert_no_leases(receiver)


def test_an_install_from_a_device_slot_is_device_to_device_and_hashes_what_it_wrote():
    L, NB, H, BS, C = 2, 16, 4, 16, 8
    caches = torch.zeros((L, NB, H, BS, C))
    layout = KVLayout.from_caches({f"l{i}": caches[i] for i in range(L)})
    bpb = layout.bytes_per_block
    chunk = torch.randint(0, 256, (L, 3, bpb), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    regions = [chunk[i, b].numpy() for i in range(L) for b in range(3)]
    hdr = make_header(b"k" * 32, "t", 0, regions, num_layers=L, num_blocks=3)
    ev = ChunkArrival("t", 0, b"k" * 32, SlotRef(0, 1), hdr, 0.0, verified=False)
    install_verified(layout, ev, chunk.reshape(-1).clone(), [9, 4], 1, Span.whole(bpb))   # block 0: D holds it
    assert torch.equal(layout.stacked[:, [9, 4]], chunk[:, 1:])
    bad = chunk.reshape(-1).clone()
    bad[7] ^= 0xFF                                                  # a byte of a held block: still verified
    with pytest.raises(ChecksumError):
        install_verified(layout, ev, bad, [9, 4], 1, Span.whole(bpb))
    half = Span(1, bpb, bpb // 2, bpb // 2)                         # a piece: half the heads of each block
    part = chunk[:, :, bpb // 2:].contiguous()
    phdr = make_header(b"k" * 32, "t", 0, [part.numpy()], num_layers=L, num_blocks=3)
    install_verified(layout, ChunkArrival("t", 0, b"k" * 32, SlotRef(0, 1), phdr, 0.0, verified=False),
                     part.reshape(-1).clone(), [1, 2, 3], 0, half)
    assert torch.equal(layout.stacked[:, [1, 2, 3], bpb // 2:], part)
