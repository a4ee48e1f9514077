"""Scheduler-side state machines of the connectors, driven with stand-in request objects.

The real-vLLM behaviour is covered end to end in tests/e2e; these pin down the
bookkeeping that is hard to provoke there: block lists across chunked-prefill steps,
delayed frees, aborts in the middle of a load, malformed params.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core import params as pd  # noqa: E402
from kvrelay.decode.connector import DecodeScheduler  # noqa: E402
from kvrelay.prefill.connector import PrefillScheduler  # noqa: E402


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class Out:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    kv_connector_worker_meta: object = None


SIGNER = pd.ParamsSigner(os.environ["KVRELAY_SECRET"].encode(), 60)


def push(tid: str = "t1") -> dict:
    return pd.params_dict(SIGNER.sign(pd.PushParams(transfer_id=tid, push_to="tcp://127.0.0.1:9100")))


def pull(tid: str = "t1", tail: int = 0) -> dict:
    return pd.params_dict(SIGNER.sign(pd.PullParams(transfer_id=tid, tail=tail)))


def sched_out(new=(), cached_ids=(), cached_new_blocks=(), cached_computed=(), scheduled=None):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached_ids), new_block_ids=list(cached_new_blocks),
                                              num_computed_tokens=list(cached_computed)),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def test_prefill_tracks_blocks_over_chunked_steps_and_delays_free():
    s = PrefillScheduler(kcfg.from_dict({}))
    r = Req("r1", list(range(1000)), push())
    s.on_request(r)
    new = SimpleNamespace(req_id="r1", block_ids=([1, 2, 3, 4],), num_computed_tokens=0,
                          prompt_token_ids=r.prompt_token_ids)
    m1 = s.build_meta(sched_out(new=[new], scheduled={"r1": 512}))
    assert [(p.ready, p.block_ids, p.token_ids is not None) for p in m1.pushes] == [(512, [1, 2, 3, 4], True)]
    m2 = s.build_meta(sched_out(cached_ids=["r1"], cached_new_blocks=[([5, 6, 7, 8],)],
                                cached_computed=[512], scheduled={"r1": 488}))
    assert m2.pushes[0].ready == 1000 and m2.pushes[0].block_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert m2.pushes[0].token_ids is None
    # A later decode step of the same request produces no more push specs.
    assert s.build_meta(sched_out(cached_ids=["r1"], cached_new_blocks=[None], cached_computed=[1000],
                                  scheduled={"r1": 1})).pushes == []
    assert s.request_finished(r, []) == (True, None)
    assert s.has_pending()
    assert s.build_meta(sched_out()).finished == ["r1"]
    s.update_output(Out(finished_sending={"r1"}))
    assert not s.has_pending()


class FixedStore:
    """Stand-in for the worker's store: it holds the first ``hit`` tokens of every prompt, and
    records what each lookup asked (prompt length, namespace)."""

    def __init__(self, hit: int) -> None:
        self.hit, self.asked = hit, list[tuple[int, bytes]]()

    def lookup(self, token_ids: list[int], namespace: bytes = b"") -> int:
        self.asked.append((len(token_ids), namespace))
        return self.hit


@pytest.mark.parametrize("store_hit,local,loaded,store_from", [
    (512, 0, 512, 512),        # the store supplies 2 chunks: save from chunk 2
    (256, 1408, 0, 256),       # the engine's cache holds 11 blocks (5.5 chunks), the store 1 chunk:
                               # chunks 1-5 are saved too (chunk 5 half from the engine's cache)
    (1536, 1408, 128, 1536),   # the store is ahead of the engine's cache: load the difference
])
def test_prefill_stores_every_full_chunk_the_store_lacks(store_hit, local, loaded, store_from):
    s = PrefillScheduler(kcfg.from_dict({"store": {"enabled": True}}), store=FixedStore(store_hit))  # type: ignore[arg-type]
    r = Req("r1", list(range(2000)), push())
    assert s.matched(r, local) == (loaded, False)
    new = SimpleNamespace(req_id="r1", block_ids=([1] * 16,), num_computed_tokens=local,
                          prompt_token_ids=r.prompt_token_ids)
    meta = s.build_meta(sched_out(new=[new], scheduled={"r1": 2000 - local - loaded}))
    assert meta.pushes[0].store_from == store_from


def test_prefill_ignores_plain_and_malformed_requests():
    s = PrefillScheduler(kcfg.from_dict({}))
    plain, bad = Req("a", [1, 2, 3]), Req("b", [1, 2], {"kvrelay": {"role": "push"}})
    s.on_request(plain)
    s.on_request(bad)                  # missing fields: logged, served without a push
    new = [SimpleNamespace(req_id=x, block_ids=([1],), num_computed_tokens=0, prompt_token_ids=[1])
           for x in ("a", "b")]
    assert s.build_meta(sched_out(new=new, scheduled={"a": 3, "b": 2})).pushes == []
    assert s.request_finished(plain, []) == (False, None)
    assert not s.has_pending()


def test_decode_reports_prompt_beyond_local_hit_as_async_and_hands_load_to_worker():
    s = DecodeScheduler(kcfg.from_dict({}))
    r = Req("d1", list(range(600)), pull("tX"))
    assert s.matched(r, 128) == (472, True)
    assert s.matched(r, 128) == (472, True)          # asked again before allocation: same answer
    s.after_alloc(r, Blocks([10, 11, 12, 13, 14]), 472)
    meta = s.build_meta()
    (load,) = meta.loads
    assert (load.transfer_id, load.local_tokens, load.num_tokens, load.block_ids) == ("tX", 128, 472,
                                                                                    [10, 11, 12, 13, 14])
    assert s.build_meta().loads == []
    assert s.matched(r, 599) == (0, False)           # after the load: never again
    assert s.has_pending()
    s.update_output(Out(finished_recving={"d1"}))
    assert not s.has_pending()
    assert s.request_finished(r, []) == (False, None)


@pytest.mark.parametrize("sync_landed", [True, False])
def test_decode_installs_a_landed_transfer_in_the_step_that_schedules_it(sync_landed):
    from kvrelay.decode.messages import LandedMeta
    s = DecodeScheduler(kcfg.from_dict({"connector": {"sync_landed": sync_landed}}))
    split, whole, early = Req("a", list(range(601)), pull("tA", 1)), Req("b", list(range(600)), pull("tB")), \
        Req("c", list(range(601)), pull("tC", 1))
    # Ranks report what landed; vLLM aggregates them (a transfer one rank lacks is not landed).
    both = LandedMeta(frozenset({"tA", "tB", "tX"})).aggregate(LandedMeta(frozenset({"tA", "tB", "tC"})))
    assert both == LandedMeta(frozenset({"tA", "tB"}))
    s.update_output(Out(kv_connector_worker_meta=both))
    # token 1 came from P (a tail D computes): loaded now, if configured; a whole prompt (no tail) and a
    # transfer not yet landed everywhere load in the background as before
    assert s.matched(split, 0) == (600, not sync_landed)
    assert s.matched(whole, 0) == (600, True)
    assert s.matched(early, 0) == (600, True)
    s.after_alloc(split, Blocks(list(range(38))), 600)
    (load,) = s.build_meta().loads
    assert load.now is sync_landed
    # a synchronous load never waits for finished_recving: nothing is pending for it
    assert s.has_pending() is not sync_landed
    assert s.matched(split, 600) == (0, False)
    s.update_output(Out(finished_recving=set() if sync_landed else {"a"}))
    assert s.request_finished(split, []) == (False, None)


def test_decode_abort_mid_load_keeps_blocks_until_worker_stops():
    s = DecodeScheduler(kcfg.from_dict({}))
    r = Req("d2", list(range(300)), pull())
    s.matched(r, 0)
    s.after_alloc(r, Blocks([4, 5, 6]), 300)
    s.build_meta()
    assert s.request_finished(r, []) == (True, None)     # worker may still write into the blocks
    assert s.build_meta().cancelled == ["d2"]
    s.update_output(Out(finished_recving={"d2"}))
    assert not s.has_pending()


def test_decode_without_params_or_with_bad_version_computes_locally():
    s = DecodeScheduler(kcfg.from_dict({}))
    assert s.matched(Req("x", [1, 2, 3]), 0) == (0, False)
    bad = {"kvrelay": {"role": "pull", "transfer_id": "t", "v": 99}}
    assert s.matched(Req("y", [1, 2, 3], bad), 0) == (0, False)
    with pytest.raises(pd.ParamsError, match="version 99"):
        pd.parse_params(bad)


@dataclass
class Done:
    """A finished request as the scheduler sees it: prompt + output, KV computed for all but the last."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    kv_transfer_params: dict | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_computed_tokens(self) -> int:
        return len(self.all_token_ids) - 1


SAVE_CFG = {"store": {"enabled": True, "save_decoded": True, "redis_url": "redis://127.0.0.1:1/0"}}


@pytest.mark.parametrize("prompt,output,saved", [
    (200, 100, (0, 1)),        # 299 computed: chunk 0 holds generated tokens 200..255
    (200, 56, ()),             # 255 computed: no whole chunk yet
    (200, 57, (0, 1)),         # 256 computed: exactly one chunk
    (512, 300, (2, 3)),        # chunks 0-1 are all prompt (the prefill node stored them)
    (600, 500, (2, 4)),        # chunk 2 straddles prompt and output; 3 is all output
    (300, 5, ()),
])
def test_decode_saves_whole_chunks_holding_output_and_delays_the_free(prompt, output, saved):
    s = DecodeScheduler(kcfg.from_dict(SAVE_CFG))
    r = Done("s1", list(range(prompt)), list(range(7, 7 + output)))
    blocks = list(range(100, 100 + -(-r.num_computed_tokens // 16)))
    delay, _ = s.request_finished(r, blocks)
    assert delay is bool(saved)
    (spec,) = s.build_meta().saves or [None]
    if not saved:
        assert spec is None and not s.has_pending()
        return
    first, n_chunks = saved
    assert (spec.first_chunk, len(spec.token_ids)) == (first, n_chunks * 256)
    assert spec.token_ids == r.all_token_ids[:n_chunks * 256] and spec.block_ids == blocks
    assert s.has_pending()
    s.update_output(Out(finished_sending={"s1"}))
    assert not s.has_pending()


def test_decode_saves_nothing_unless_configured_and_config_needs_redis():
    s = DecodeScheduler(kcfg.from_dict({"store": {"enabled": True}}))
    assert s.request_finished(Done("s2", list(range(200)), list(range(300))), list(range(40))) == (False, None)
    with pytest.raises(kcfg.ConfigError, match="store.redis_url"):
        kcfg.from_dict({"store": {"enabled": True, "save_decoded": True}})


@dataclass
class MMReq(Req):
    mm_features: list = field(default_factory=lambda: [object()])    # an image's placeholder tokens


def test_multimodal_requests_bypass_the_push_the_pull_and_the_store():
    """Their placeholder token ids do not name the image: keys would collide across images."""
    p = PrefillScheduler(kcfg.from_dict({}))
    r = MMReq("m1", list(range(600)), push())
    p.on_request(r)
    new = SimpleNamespace(req_id="m1", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0,
                          prompt_token_ids=r.prompt_token_ids)
    assert p.build_meta(sched_out(new=[new], scheduled={"m1": 600})).pushes == []
    assert p.request_finished(r, [1, 2, 3, 4, 5]) == (False, None)
    d = DecodeScheduler(kcfg.from_dict({"store": {"enabled": True, "save_decoded": True,
                                                  "redis_url": "redis://127.0.0.1:1"}}))
    q = MMReq("m2", list(range(600)), pull())
    assert d.matched(q, 0) == (0, False)                                # computed on D, never loaded
    assert d.request_finished(q, [1, 2, 3, 4, 5]) == (False, None)      # and never saved


@pytest.mark.parametrize(("p_tp", "d_tp", "parts", "landed"), [
    (1, 1, {"T", "kvr-a#p9"}, {"T", "kvr-a#p9"}),      # one sender: the part is the transfer (any id)
    (2, 1, {"T#p0"}, set()),                           # two senders, one piece still out
    (2, 1, {"T#p0", "T#p1", "U#p1"}, {"T"}),
])
def test_decode_rank_reports_a_transfer_landed_only_when_every_piece_it_receives_has(p_tp, d_tp, parts, landed):
    from kvrelay.core.ranks import plan, receives
    from kvrelay.decode.installer import InstallWorker
    pieces = plan(4, p_tp, d_tp)
    rank = SimpleNamespace(pieces=tuple(pieces), incoming=lambda: receives(pieces, 0))
    worker = SimpleNamespace(receiver=SimpleNamespace(landed=lambda: set(parts)), ranks=rank)
    assert InstallWorker.landed(worker) == landed


@dataclass
class LoraReq(Req):
    lora_request: object = None


def test_an_adapters_requests_carry_its_namespace_into_every_key_the_workers_compute(tmp_path):
    """Lookups, store loads, pushes, pulls and decode-side saves all name the adapter (core/kv_namespace.py)."""
    from kvrelay.core.kv_namespace import kv_namespace
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w" * 32)
    lora = SimpleNamespace(lora_name="sql", lora_path=str(tmp_path))
    ns = kv_namespace(SimpleNamespace(lora_request=lora))
    assert ns.startswith(b"lora:sql:")
    store = FixedStore(hit=512)
    p = PrefillScheduler(kcfg.from_dict({"store": {"enabled": True}}), store)
    r = LoraReq("a1", list(range(600)), push(), lora)
    assert p.matched(r, 0) == (512, False) and store.asked == [(600, ns)]
    p.after_alloc(r, Blocks([1, 2, 3, 4, 5]), 512)
    new = SimpleNamespace(req_id="a1", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=512,
                          prompt_token_ids=r.prompt_token_ids)
    meta = p.build_meta(sched_out(new=[new], scheduled={"a1": 88}))
    assert [ld.namespace for ld in meta.loads] == [ns] and [s.namespace for s in meta.pushes] == [ns]
    base = Req("b1", list(range(600)), push())
    p.matched(base, 0)
    assert store.asked[-1] == (600, b""), "the base model's lookup names no adapter"
    d = DecodeScheduler(kcfg.from_dict({}))
    q = LoraReq("a2", list(range(600)), pull("t2"), lora)
    assert d.matched(q, 0) == (600, True)
    d.after_alloc(q, Blocks([1, 2, 3, 4, 5]), 600)
    assert [ld.namespace for ld in d.build_meta().loads] == [ns]


def test_a_scheduler_half_stops_its_allowlist_refresher_when_closed():
    """The prefill scheduler's push allowlist refreshes DNS on a thread; closing the half (vLLM's
    shutdown) stops it, so no thread outlives the engine's connector."""
    import threading

    from kvrelay.core.params import ParamsVerifier, PushParams

    before = {t for t in threading.enumerate() if t.name == "kvrelay-allowlist-dns"}
    verifier = ParamsVerifier(b"k" * 32, PushParams, allowed_push=["tcp://localhost:9100"])
    thread = next(t for t in threading.enumerate() if t.name == "kvrelay-allowlist-dns" and t not in before)
    verifier.close()
    thread.join(10)
    assert not thread.is_alive()
