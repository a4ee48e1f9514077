"""Verify-in-install on the decode node: a chunk the transport did not hash on arrival (nixl,
shm, ucx) is scattered straight from its slot into the engine's blocks, and the checksum is
taken over the bytes that were written - the installed blocks read back, plus the slot's
bytes of blocks D already held. The bytes installed are then exactly the bytes verified, and
no private copy of the chunk is made on a CPU cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvrelay.common.wire import DataMac, make_header  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.decode.installer import InstallWorker, _Load  # noqa: E402
from kvrelay.decode.specs import LoadSpec  # noqa: E402
from kvrelay.kernels.span import Span  # noqa: E402
from kvrelay.transport.events import ChunkArrival  # noqa: E402
from kvrelay.transport.pool import SlotRef  # noqa: E402

BLOCK, CHUNK, LAYERS, NUM_BLOCKS = 16, 32, 3, 12          # 2 blocks per chunk


class SlotStub:
    """The receiver's two calls an install makes: the slot's payload bytes, and the release."""

    def __init__(self, payload: bytes, data_mac: DataMac | None = None) -> None:
        self.buf = bytearray(payload)
        self.released = 0
        self.data_mac = data_mac

    def payload(self, ev: ChunkArrival) -> memoryview:
        return memoryview(self.buf)

    def release(self, ev: ChunkArrival) -> None:
        self.released += 1


def _worker(*more: str) -> InstallWorker:
    cfg = kcfg.load(overrides=[f"chunk_tokens={CHUNK}", "transport.backend=tcp", "connector.helper_cpus=inherit",
                               *more])
    vc = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK),
                         model_config=SimpleNamespace(model="t", max_model_len=256),
                         parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1),
                         kv_transfer_config=SimpleNamespace(engine_id="install-verify"))
    w = InstallWorker(cfg, vc)
    stacked = torch.zeros((LAYERS, NUM_BLOCKS, 2, BLOCK, 8))           # CPU attention: one plane per layer
    w.register({f"l{i}": stacked[i] for i in range(LAYERS)})
    return w


@pytest.fixture
def worker():
    w = _worker()
    real = w.receiver
    yield w
    w.receiver = real
    w.close()


def _chunk(w: InstallWorker, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYERS, 2, w.layout.bytes_per_block), dtype=torch.uint8, generator=g)


def _arrive(w: InstallWorker, payload: torch.Tensor, *, local_tokens: int = 0, corrupt: int | None = None,
            part: int = 0, load: _Load | None = None, mac: DataMac | None = None, forge: bool = False,
            verified: bool = False) -> _Load:
    """Install ``payload`` as piece ``part`` of chunk 0 of a 32-token prompt into blocks [5, 9]."""
    spec = LoadSpec("r", "t", list(range(CHUNK)), [5, 9], local_tokens, CHUNK - local_tokens)
    if load is None:
        parts = w._parts(spec)
        load = _Load(spec, 1, parts, running=len(parts))
    piece = load.parts[part]
    key = piece.keys[0]
    regions = [payload[i, b].numpy() for i in range(LAYERS) for b in range(2)]
    header = make_header(key, piece.transfer_id, 0, regions, num_layers=LAYERS, num_blocks=2, mac=mac)
    body = bytearray(payload.numpy().tobytes())
    if corrupt is not None:
        body[corrupt] ^= 0xFF                              # a byte flipped after the checksum was taken
    if forge:       # an attacker on the wire: other KV, with every checksum recomputed (the MAC kept)
        body = bytearray(torch.flip(payload, [2]).contiguous().numpy().tobytes())
        forged = make_header(key, piece.transfer_id, 0, [bytes(body)], num_layers=LAYERS, num_blocks=2)
        header = ChunkHeaderReplace(forged, header.mac)
    w.receiver = SlotStub(bytes(body), w.cfg.transport.data_signer() if w.cfg.transport.data_mac else None)
    w._install(load, piece, ChunkArrival(piece.transfer_id, 0, key, SlotRef(0, 1), header, 0.0, verified=verified))
    return load


def _installed(w: InstallWorker, blocks: list[int]) -> torch.Tensor:
    return torch.stack([torch.stack([w.layout.block_view(i, b) for b in blocks]) for i in range(LAYERS)])


def test_an_intact_chunk_is_installed_byte_exact(worker):
    payload = _chunk(worker, 1)
    load = _arrive(worker, payload)
    assert load.parts[0].installed == {0} and not load.failed()
    assert torch.equal(_installed(worker, [5, 9]), payload)
    assert worker.receiver.released == 1


def test_a_corrupt_chunk_is_caught_after_install_and_reported(worker):
    load = _arrive(worker, _chunk(worker, 2), corrupt=worker.layout.bytes_per_block * 3 + 7)
    assert 0 in load.failed() and "checksum" in load.failed()[0]
    assert load.parts[0].installed == set() and worker.receiver.released == 1


def test_blocks_d_already_held_are_not_written_but_still_verified(worker):
    """local_tokens=16: D's own prefix cache holds block 5; only block 9 is written, and the
    checksum still covers the whole payload (the held block's bytes read from the slot)."""
    before = worker.layout.block_view(0, 5).clone()
    payload = _chunk(worker, 3)
    load = _arrive(worker, payload, local_tokens=BLOCK)
    assert load.parts[0].installed == {0} and not load.failed()
    assert torch.equal(worker.layout.block_view(0, 5), before)
    assert torch.equal(_installed(worker, [9]), payload[:, 1:])
    held_byte = worker.layout.bytes_per_block * 2 + 7          # layer 1, block 0: a block D holds
    assert _arrive(worker, _chunk(worker, 4), local_tokens=BLOCK, corrupt=held_byte).failed()


def ChunkHeaderReplace(hdr, mac: bytes):      # noqa: N802 - reads as the constructor it stands for
    import dataclasses

    return dataclasses.replace(hdr, mac=mac)


@pytest.mark.parametrize("verified", [False, True], ids=["hashed-at-install", "hashed-on-arrival"])
def test_a_forged_chunk_with_recomputed_checksums_is_refused_only_with_the_data_mac(verified):
    """The checksums catch accidents: a chunk rewritten on the wire with its checksums recomputed
    installs (other KV than P computed). With ``transport.data_mac`` the keyed MAC, which the
    attacker cannot recompute without the secret, refuses it; an honest signed chunk installs."""
    plain = _worker()
    signed = _worker("transport.data_mac=true")
    real = plain.receiver, signed.receiver
    try:
        mac = signed.cfg.transport.data_signer()
        assert mac is not None
        assert not _arrive(plain, _chunk(plain, 6), forge=True, verified=verified).failed()      # accepted
        assert torch.equal(_installed(plain, [5, 9]), torch.flip(_chunk(plain, 6), [2]))
        bad = _arrive(signed, _chunk(signed, 6), mac=mac, forge=True, verified=verified)
        assert 0 in bad.failed() and "MAC" in bad.failed()[0]
        honest = _arrive(signed, _chunk(signed, 7), mac=mac, verified=verified)
        assert not honest.failed() and torch.equal(_installed(signed, [5, 9]), _chunk(signed, 7))
        other = DataMac(b"another secret's key".ljust(32, b"."))
        assert 0 in _arrive(signed, _chunk(signed, 8), mac=other, verified=verified).failed()
    finally:
        plain.receiver, signed.receiver = real
        plain.close()
        signed.close()


def test_two_prefill_ranks_pieces_make_one_chunk():
    """Prefill TP2 -> decode TP1: each prefill rank sends one of the block's two heads; each
    piece lands in its own byte range, is verified there, and the chunk is whole only with both."""
    w = _worker("engine.prefill_tp=2")
    real = w.receiver
    try:
        bpb = w.layout.bytes_per_block
        assert [(p.transfer_id, p.span) for p in w._parts(LoadSpec("r", "t", [1], [5], 0, 1))] == [
            ("t#p0", Span(1, bpb, 0, bpb // 2)), ("t#p1", Span(1, bpb, bpb // 2, bpb // 2))]
        full = _chunk(w, 5)                                           # [L, 2 blocks, bpb]
        half = w.layout.bytes_per_block // 2
        load = _arrive(w, full[:, :, :half].contiguous())
        assert load.parts[0].installed == {0} and load.parts[1].installed == set()
        load = _arrive(w, full[:, :, half:].contiguous(), part=1, load=load)
        assert all(p.installed == {0} for p in load.parts) and not load.failed()
        assert torch.equal(_installed(w, [5, 9]), full)
        bad = _arrive(w, full[:, :, half:].contiguous(), part=1, corrupt=5)     # a corrupt second piece
        assert 0 in bad.failed()
    finally:
        w.receiver = real
        w.close()


def test_a_load_never_queues_behind_loads_stalled_on_their_prefill_node():
    """40 loads wait for chunks that never come (a slow or dead P); a 41st, cancelled at once, must
    settle at once. Before the fix 32 install threads were all taken by the stalled loads, so
    the 41st waited for one of them to time out (``connector.first_chunk_s``) before it ran."""
    import time

    w = _worker("connector.first_chunk_s=20")
    try:
        stalled = [LoadSpec(f"s{i}", f"ts{i}", list(range(CHUNK)), [1, 2], 0, CHUNK) for i in range(40)]
        w.start(stalled, [], [])
        time.sleep(0.5)
        w.start([LoadSpec("late", "tlate", list(range(CHUNK)), [3, 4], 0, CHUNK)], [], [])
        t0 = time.monotonic()
        w.start([], ["late"], [])                            # its request was aborted
        done: set[str] = set()
        while "late" not in done:
            assert time.monotonic() - t0 < 5, "the load queued behind the stalled ones"
            done |= w.take_finished()
            time.sleep(0.05)
        w.start([], [s.req_id for s in stalled], [])
    finally:
        w.close()
