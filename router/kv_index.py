"""What every engine's prefix cache holds, from vLLM's own KV-cache events.

vLLM started with ``--kv-events-config`` publishes, after each engine step, a batch of
``BlockStored`` (full blocks now in its prefix cache: vLLM's hashes, the parent block's
hash and the blocks' tokens), ``BlockRemoved`` (evicted) and ``AllBlocksCleared`` on a
ZeroMQ PUB socket (:mod:`kvrelay.router.kv_events` follows it). This module is the state
those events build, with no I/O.

Keys are the router's own: a block's key hashes its parent's key and its tokens (and its
extra keys: LoRA, multimodal, cache salt), so the index needs neither vLLM's hash function
nor its seed, and stays torch-free. A prompt's leading blocks get keys by the same chain,
and :meth:`KVIndex.held` answers how many leading tokens of it each engine holds.

The contract: an engine is never claimed to hold a block it announced as removed or
cleared, nor anything from before a restart (the batch sequence number starts again), a
lost connection (:meth:`KVIndex.forget`) or a gap in the sequence (a missed batch may have
removed any block: the engine's claims are dropped and rebuilt from its next events). A stale
claim would only cost a worse choice - the engine computes what it lacks, so answers never
depend on the index. Memory is bounded per engine (``max_blocks``: the oldest blocks are
forgotten first, in O(1) each).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

BlockHash = int | bytes          # vLLM's ExternalBlockHash
MAX_ADAPTERS = 4096              # LoRA names remembered (names come from engines, not clients)
_ROOT = b"kvrelay-kv-index-v1"


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """vLLM's event (``vllm/distributed/kv_events.py``): only the fields the index reads."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[object | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's ``KVEventBatch``: one engine step's events (a msgpack array on the wire)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` for anything else."""
    return _DECODER.decode(payload)


def _indexed(medium: str | None, group: int | None) -> bool:
    """The device cache of the first KV-cache group: what a request's prefill reuses
    (offloaded copies, ``medium`` CPU / STORAGE, live elsewhere and are not counted)."""
    return medium in (None, "GPU") and group in (None, 0)


def chain_key(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Block key: ``blake2b(parent key, tokens, extras)``, 16 bytes."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def adapter_extra(adapter: str | None) -> bytes:
    """The extras of every block of a plain text prompt under LoRA adapter ``adapter``, as
    :func:`_extra` reads them from vLLM's events (``extra_keys`` per block: the adapter's name)."""
    return msgspec.msgpack.encode([[adapter], adapter]) if adapter else b""


def prompt_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> list[bytes]:
    """Keys of the prompt's full blocks, in order (a plain text prompt, under ``adapter`` if any)."""
    keys, parent, extra = [], _ROOT, adapter_extra(adapter)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start:start + block_size], extra)
        keys.append(parent)
    return keys


@dataclass
class EngineBlocks:
    """One engine's view: its blocks (vLLM hash -> our key, oldest first) and its last batch."""

    block_size: int = 0
    by_hash: OrderedDict[BlockHash, bytes] = field(default_factory=OrderedDict)   # oldest first, O(1) at both ends
    seq: int = -1


@dataclass
class IndexStats:
    batches: int = 0
    missed_batches: int = 0      # batches lost in sequence gaps (each gap drops the engine's claims)
    restarts: int = 0            # sequence went back: the engine (or its publisher) started again
    broken_chains: int = 0       # stored blocks whose parent we never saw (skipped)
    dropped_for_bound: int = 0   # blocks forgotten to keep an engine under max_blocks


class KVIndex:
    """``block key -> engines`` over every followed engine (keyed by its URL)."""

    def __init__(self, max_blocks: int = 262144) -> None:
        self.max_blocks = max_blocks
        self.engines: dict[str, EngineBlocks] = {}
        self.holders: dict[bytes, set[str]] = {}
        self.adapters: set[str] = set()      # LoRA names seen in events: a request's model names one or the base
        self.stats = IndexStats()

    # ------------------------------------------------------------------ events
    def apply(self, url: str, seq: int, batch: EventBatch) -> None:
        """One batch from engine ``url`` with the publisher's sequence number ``seq``."""
        eng = self.engines.setdefault(url, EngineBlocks())
        if seq <= eng.seq:                   # a new publisher: everything we knew is gone
            self.stats.restarts += 1
            self.forget(url)
            eng = self.engines.setdefault(url, EngineBlocks())
        elif eng.seq >= 0 and seq > eng.seq + 1:  # a lost batch may have removed anything we hold
            self.stats.missed_batches += seq - eng.seq - 1
            self.forget(url)
            eng = self.engines.setdefault(url, EngineBlocks())
        eng.seq = seq
        self.stats.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(url, eng, ev)
            elif isinstance(ev, BlockRemoved):
                if _indexed(ev.medium, ev.group_idx):
                    self._removed(url, eng, ev.block_hashes)
            else:
                self._clear(url, eng)

    def _stored(self, url: str, eng: EngineBlocks, ev: BlockStored) -> None:
        if not _indexed(ev.medium, ev.group_idx):
            return
        if ev.parent_block_hash is None:
            parent = _ROOT
        elif (known := eng.by_hash.get(ev.parent_block_hash)) is not None:
            parent = known
        else:                                # we missed the parent's event: no chain to hang these on
            self.stats.broken_chains += 1
            return
        eng.block_size = ev.block_size
        if ev.lora_name and len(self.adapters) < MAX_ADAPTERS:
            self.adapters.add(ev.lora_name)
        for i, h in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            if len(tokens) < ev.block_size:
                return
            parent = chain_key(parent, tokens, _extra(ev, i))
            if eng.by_hash.get(h) == parent:
                continue
            self._removed(url, eng, (h,))
            eng.by_hash[h] = parent
            self.holders.setdefault(parent, set()).add(url)
        while len(eng.by_hash) > self.max_blocks:
            self.stats.dropped_for_bound += 1
            h, key = eng.by_hash.popitem(last=False)
            self._unhold(url, key)

    def _removed(self, url: str, eng: EngineBlocks, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            key = eng.by_hash.pop(h, None)
            if key is not None:
                self._unhold(url, key)

    def _unhold(self, url: str, key: bytes) -> None:
        if (held := self.holders.get(key)) is not None:
            held.discard(url)
            if not held:
                del self.holders[key]

    def _clear(self, url: str, eng: EngineBlocks) -> None:
        self._removed(url, eng, list(eng.by_hash))

    def forget(self, url: str) -> None:
        """Engine ``url`` left, restarted or went silent: it holds nothing we know of."""
        eng = self.engines.pop(url, None)
        if eng is not None:
            self._clear(url, eng)

    # ------------------------------------------------------------------ queries
    def adapter_of(self, model: object) -> str | None:
        """The LoRA adapter a request for ``model`` runs under: ``model`` itself when engines have
        cached blocks under that name, else None (the base model; an adapter no engine has cached
        yet is held nowhere under either reading)."""
        return model if isinstance(model, str) and model in self.adapters else None

    def held(self, token_ids: Sequence[int], urls: Iterable[str], adapter: str | None = None) -> dict[str, int]:
        """Per engine of ``urls`` that holds any: the leading tokens of ``token_ids`` (computed
        under LoRA ``adapter``, None for the base model) in its cache."""
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for url in urls:
            eng = self.engines.get(url)
            if eng is not None and eng.block_size:
                by_size.setdefault(eng.block_size, []).append(url)
        for size, group in by_size.items():
            alive = set(group)
            for depth, key in enumerate(prompt_keys(token_ids, size, adapter), 1):
                alive &= self.holders.get(key, set())
                if not alive:
                    break
                for url in alive:
                    out[url] = depth * size
        return out

    def blocks(self, url: str) -> int:
        eng = self.engines.get(url)
        return len(eng.by_hash) if eng else 0


def _extra(ev: BlockStored, i: int) -> bytes:
    """What besides the tokens vLLM hashes for block ``i`` (LoRA, multimodal, cache salt)."""
    extra = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
    lora = ev.lora_name or ev.lora_id
    if extra is None and lora is None:
        return b""
    return msgspec.msgpack.encode([extra, lora])
