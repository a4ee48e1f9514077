"""prefill/staging.py: the push's gather buffers are lent, taken back and reused, never waited for."""

from __future__ import annotations

import threading

import pytest
import torch

from kvrelay.prefill.staging import MIN_SLOTS, STAGING_BYTES, StagingPool, staging_slots

SHAPE = (2, 4, 128)          # [L, n, bytes_per_block]: 1 KiB


def test_a_buffer_given_back_is_lent_again():
    pool = StagingPool(1024, slots=2)
    a = pool.take(SHAPE)
    assert a.tensor.shape == SHAPE and a.tensor.dtype == torch.uint8 and a.tensor.is_contiguous()
    pool.give_back(a)
    b = pool.take((2, 2, 128))                            # a partial chunk: the front of the same buffer
    assert b.slot is a.slot and b.tensor.data_ptr() == a.slot.data_ptr()
    st = pool.stats()
    assert (st.made, st.lent, st.free, st.reused, st.misses) == (1, 1, 0, 1, 0)


def test_with_every_buffer_out_a_take_allocates_instead_of_waiting():
    pool = StagingPool(1024, slots=2)
    held = [pool.take(SHAPE) for _ in range(2)]
    extra = pool.take(SHAPE)                              # must not block
    assert extra.slot is None and all(extra.tensor.data_ptr() != h.slot.data_ptr() for h in held)
    pool.give_back(extra)                                 # a one-off buffer is not kept
    st = pool.stats()
    assert (st.made, st.lent, st.free, st.misses) == (2, 2, 0, 1)


def test_a_retired_buffer_is_never_lent_again_and_is_replaced():
    pool = StagingPool(1024, slots=1)
    a = pool.take(SHAPE)
    pool.retire(a)                                        # its write was cancelled: a send may still read it
    b = pool.take(SHAPE)
    assert b.slot is not None and b.slot is not a.slot
    assert pool.stats().made == 1 and pool.stats().lent == 1


def test_a_chunk_larger_than_a_slot_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        StagingPool(512, slots=2).take(SHAPE)


def test_concurrent_lanes_never_share_a_buffer():
    pool = StagingPool(1024, slots=4)
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[str] = []

    def lane(mark: int) -> None:
        for _ in range(300):
            s = pool.take(SHAPE)
            s.tensor.fill_(mark)
            if not bool((s.tensor == mark).all()):
                errors.append(f"lane {mark}: its buffer was written by another lane")
            with lock:
                seen.append(s.tensor.data_ptr())
            pool.give_back(s)

    threads = [threading.Thread(target=lane, args=(m,)) for m in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = pool.stats()
    assert st.lent == 0 and st.made <= 4 and st.free == st.made and st.reused >= 1200 - 4 - st.misses


def test_slots_hold_two_maximal_prompts_within_the_byte_cap():
    assert staging_slots(2 << 20, 4096, 256) == 32                      # 2 x 16 chunks, 64 MiB
    assert staging_slots(32 << 20, 4096, 256) == STAGING_BYTES // (32 << 20)
    assert staging_slots(512 << 20, 4096, 256) == MIN_SLOTS            # a huge chunk: still two
    assert staging_slots(1 << 20, 256, 256) == 2
