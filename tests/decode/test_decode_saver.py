"""Decode-side saves against a real redis-server: the records hold exactly the engine's
block bytes, chunks Redis already has are not rewritten, and a dead Redis is a warning
that still releases the request's blocks."""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")

from kvrelay.bench.local_redis import REDIS, redis_server  # noqa: E402
from kvrelay.common.keys import Fingerprint, chunk_keys  # noqa: E402
from kvrelay.common.wire import HEADER_SIZE, verify_chunk  # noqa: E402
from kvrelay.core import config as kcfg  # noqa: E402
from kvrelay.core.telemetry import EventLog  # noqa: E402
from kvrelay.decode.saver import DecodeSaver, SaveSpec  # noqa: E402
from kvrelay.kernels.layout import KVLayout  # noqa: E402
from kvrelay.store.records import seal_for  # noqa: E402
from kvrelay.store.tiers import RedisTier  # noqa: E402
from tests.kernels.test_kernels import BS, expected_chunk, vllm_like_caches  # noqa: E402

FP = Fingerprint("tiny", "bf16", "cpu", BS, 4, 65536)
T = 256                                     # chunk_tokens: 2 blocks of 128


def _saver(url: str, events: str, done: list[str]) -> tuple[DecodeSaver, dict]:
    cfg = kcfg.from_dict({"store": {"enabled": True, "save_decoded": True, "redis_url": url}})
    caches = vllm_like_caches(seed=3)
    saver = DecodeSaver(cfg, T // BS, EventLog(events, "decode-test"), done.append)
    saver.bind(KVLayout.from_caches(caches), FP)
    return saver, caches


def _wait(done: list[str], rid: str) -> None:
    deadline = time.monotonic() + 10
    while rid not in done:
        assert time.monotonic() < deadline, f"save of {rid} never reported done"
        time.sleep(0.01)


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed (deploy/setup.sh installs it)")
def test_saves_exact_block_bytes_skips_present_chunks_and_survives_a_dead_redis(tmp_path, caplog):
    tokens, blocks = list(range(1000, 1000 + 3 * T)), [9, 2, 11, 4, 0, 7]     # 3 chunks, 2 blocks each
    keys = chunk_keys(tokens, FP, T)
    events = tmp_path / "events.jsonl"
    with redis_server(tmp_path) as (url, proc):
        done: list[str] = []
        saver, caches = _saver(url, str(events), done)
        saver.submit([SaveSpec("r1", tokens, blocks, first_chunk=1)])
        _wait(done, "r1")
        got = RedisTier(url, seal=seal_for(os.environ["KVRELAY_SECRET"].encode())).get(keys)
        assert got[0] is None                                  # chunk 0 is all prompt: P's job
        for c in (1, 2):
            rec = got[c]
            assert rec is not None
            verify_chunk(bytearray(rec), key=keys[c], chunk_index=c)
            assert rec[HEADER_SIZE:] == expected_chunk(caches, blocks[2 * c:2 * c + 2])
        saver.submit([SaveSpec("r2", tokens, blocks, first_chunk=1)])       # the same chunks again
        _wait(done, "r2")
        proc.kill()
        proc.wait()
        saver.submit([SaveSpec("r3", list(range(5000, 5000 + 2 * T)), blocks[:4], first_chunk=0)])
        _wait(done, "r3")                                     # blocks are released all the same
        saver.close()
    evs = {e["req"]: e for e in map(json.loads, events.read_text().splitlines())}
    assert (evs["r1"]["chunks"], evs["r1"]["written"]) == (2, 2)
    assert (evs["r2"]["chunks"], evs["r2"]["written"]) == (2, 0)
    assert (evs["r3"]["chunks"], evs["r3"]["written"]) == (2, 0)
    assert "redis tier unavailable" in caplog.text
    assert not saver.busy()
