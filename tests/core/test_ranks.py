"""The head arithmetic of tensor-parallel transfers (core/ranks.py), against vLLM's own rule."""

from __future__ import annotations

import itertools

import pytest

from kvrelay.common.errors import ConfigError
from kvrelay.common.keys import ROOT_KEY
from kvrelay.core.ranks import (
    Heads,
    Piece,
    Sharding,
    part_transfer_id,
    piece_key,
    plan,
    rank_endpoint,
    receives,
    sends,
)


def vllm_heads(kv_heads: int, tp: int, rank: int) -> set[int]:
    """vLLM's split, written out independently: max(1, H // T) heads per rank, replicated when T > H."""
    per = max(1, kv_heads // tp)
    first = rank * kv_heads // tp if tp <= kv_heads else rank // (tp // kv_heads)
    return set(range(first, first + per))


@pytest.mark.parametrize(("kv_heads", "tp"), [(4, 1), (4, 2), (4, 4), (4, 8), (8, 2), (1, 4), (2, 8)])
def test_sharding_matches_vllm(kv_heads: int, tp: int) -> None:
    s = Sharding(kv_heads, tp)
    for r in range(tp):
        assert set(range(s.heads(r).start, s.heads(r).stop)) == vllm_heads(kv_heads, tp, r)


@pytest.mark.parametrize(("kv_heads", "tp"), [(4, 3), (6, 4), (4, 6)])
def test_sharding_refuses_what_does_not_divide(kv_heads: int, tp: int) -> None:
    with pytest.raises(ConfigError, match="TP"):
        Sharding(kv_heads, tp)


@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"),
                         list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])))
def test_every_decode_rank_gets_each_head_it_needs_exactly_once(kv_heads: int, p_tp: int, d_tp: int) -> None:
    pieces = plan(kv_heads, p_tp, d_tp)
    p, d = Sharding(kv_heads, p_tp), Sharding(kv_heads, d_tp)
    for dst in range(d_tp):
        got = [h for pc in receives(pieces, dst) for h in range(pc.heads.start, pc.heads.stop)]
        assert sorted(got) == list(range(d.heads(dst).start, d.heads(dst).stop))      # no gap, no duplicate
        senders = [pc.src for pc in receives(pieces, dst)]
        assert len(senders) == len(set(senders))        # one piece (one sub-transfer) per sender
    for pc in pieces:                                  # a sender holds what it sends, and is its lowest holder
        assert pc.heads.start >= p.heads(pc.src).start and pc.heads.stop <= p.heads(pc.src).stop
        assert all(p.first_holder(h) == pc.src for h in range(pc.heads.start, pc.heads.stop))


def test_equal_tp_is_rank_to_rank_whole_slices() -> None:
    assert plan(4, 2, 2) == [Piece(0, 0, Heads(0, 2)), Piece(1, 1, Heads(2, 4))]


def test_mixed_tp_reshards() -> None:
    assert plan(4, 2, 1) == [Piece(0, 0, Heads(0, 2)), Piece(1, 0, Heads(2, 4))]      # two P ranks feed one D rank
    assert plan(4, 1, 2) == [Piece(0, 0, Heads(0, 2)), Piece(0, 1, Heads(2, 4))]      # one P rank feeds two
    assert sends(plan(2, 4, 1), 1) == [] and sends(plan(2, 4, 1), 3) == []           # replicas stay home


def test_sub_transfer_ids_and_endpoints() -> None:
    pieces = plan(4, 2, 1)
    assert [part_transfer_id("t", pc, pieces) for pc in pieces] == ["t#p0", "t#p1"]
    assert [part_transfer_id("t", pc, plan(4, 2, 2)) for pc in plan(4, 2, 2)] == ["t", "t"]
    assert rank_endpoint("tcp://10.0.0.5:9100", 0) == "tcp://10.0.0.5:9100"
    assert rank_endpoint("tcp://10.0.0.5:9100", 3) == "tcp://10.0.0.5:9103"
    assert rank_endpoint("tcp://[::1]:9100", 1) == "tcp://[::1]:9101"


def test_piece_keys_name_the_heads() -> None:
    keys = {piece_key(ROOT_KEY, h, 4) for h in (Heads(0, 2), Heads(2, 4), Heads(0, 4))}
    assert len(keys) == 3 and piece_key(ROOT_KEY, Heads(0, 2), 8) not in keys
