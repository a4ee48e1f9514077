"""The router's global chunk index for cache-aware routing.

Each prefill node publishes ``StoreEvent``s (chunk keys stored / evicted) on a ZeroMQ
PUB socket; the router subscribes to every node and keeps ``key -> {nodes}``. To route a
request it tokenises the prompt with the model's tokenizer exactly as vLLM does
(completions: the prompt; chat: the chat template with the generation prompt), computes
the chunk keys with the fingerprint the nodes announced, and asks which node holds the
longest run of leading keys. The pick (:meth:`router.pools.Pool.pick`) weighs that against
load, both in prompt tokens: the node with the least ``prompt - cached + load_weight *
pending`` wins, ``pending`` being the prompt tokens sent to that node and not yet answered.

Events are hints: a lost or late event only costs a less optimal pick, never a wrong
answer (the chosen node verifies everything it loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.pools import Node, PrefixHint
from transport.keys import chunk_keys_from_digest
from transport.store.events import StoreEvent, decode_event

log = logging.getLogger("kvrelay.router")


class ChunkIndex:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.holders: dict[bytes, set[int]] = defaultdict(set)
        self.fingerprint = b""
        self.chunk_tokens = 0
        self.events = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx = zmq.asyncio.Context.instance()

    def start(self) -> None:
        for i, node in enumerate(self.nodes):
            if node.events_endpoint:
                self._tasks.append(asyncio.create_task(self._follow(i, node.events_endpoint)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _follow(self, i: int, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            while True:
                raw = await sock.recv()
                try:
                    ev = decode_event(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("bad store event from %s: %s", endpoint, exc)
                    continue
                self.apply(i, ev)
        finally:
            sock.close(linger=0)

    def apply(self, i: int, ev: StoreEvent) -> None:
        self.events += 1
        if self.fingerprint and ev.fingerprint != self.fingerprint:
            log.warning("node %s announces a different engine fingerprint; ignoring its events", self.nodes[i].url)
            return
        self.fingerprint, self.chunk_tokens = ev.fingerprint, ev.chunk_tokens
        for k in ev.keys:
            if ev.kind == "stored":
                self.holders[k].add(i)
            elif (held := self.holders.get(k)) is not None:
                held.discard(i)
                if not held:
                    del self.holders[k]             # an evicted key leaves no empty entry behind

    def prefix_hits(self, token_ids: list[int]) -> list[int]:
        """Per node: how many leading full chunks of ``token_ids`` it holds."""
        hits = [0] * len(self.nodes)
        if not self.fingerprint:
            return hits
        alive = set(range(len(self.nodes)))
        for depth, key in enumerate(chunk_keys_from_digest(token_ids[: len(token_ids) // self.chunk_tokens * self.chunk_tokens],
                                                                 self.fingerprint, self.chunk_tokens), 1):
            alive &= self.holders.get(key, set())
            if not alive:
                break
            for i in alive:
                hits[i] = depth
        return hits

    def hint(self, token_ids: list[int]) -> PrefixHint:
        """The prompt's length and each node's cached leading tokens, for the pick."""
        return PrefixHint(len(token_ids), tuple(h * self.chunk_tokens for h in self.prefix_hits(token_ids)))


class PromptTokenizer:
    """Tokenise request bodies the way vLLM's OpenAI server does (for key computation only)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)

    def __call__(self, body: dict[str, Any]) -> list[int] | None:
        if "messages" in body:
            ids: Any = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):          # a BatchEncoding in newer transformers
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self.tok(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None
