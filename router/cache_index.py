"""The router's global chunk index for cache-aware routing.

Each prefill node publishes ``StoreEvent``s (chunk keys stored / evicted) on a ZeroMQ
PUB socket; the router subscribes to every node and keeps ``key -> {nodes}``. To route a
request it tokenises the prompt with the model's tokenizer exactly as vLLM does
(completions: the prompt; chat: the chat template with the generation prompt), computes
the chunk keys with the fingerprint the nodes announced, and asks which node holds the
longest run of leading keys. The pick (:meth:`kvrelay.router.pools.Pool.pick`) weighs that against
load, both in prompt tokens: the node with the least ``prompt - cached + load_weight *
pending`` wins, ``pending`` being the prompt tokens sent to that node and not yet answered.

Events are hints: a lost or late event only costs a less optimal pick, never a wrong
answer (the chosen node verifies everything it loads). The index is bounded (``max_keys``,
the keys stored longest ago go first). Every node announces its engine fingerprint; the
index follows the one most current nodes share (a rolling redeploy moves it along once the
new fingerprint is the majority) and ignores the others' keys, which it could not match.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any

import msgspec

from kvrelay.common.errors import ConfigError
from kvrelay.common.keys import chunk_keys_from_digest
from kvrelay.router.followers import Followers, subscriber
from kvrelay.router.pools import Pool, PrefixHint
from kvrelay.store.publisher import StoreEvent, decode_event, published_key

log = logging.getLogger("kvrelay.router")


class ChunkIndex:
    """``chunk key -> prefill node urls`` from the nodes' store events, following the pool:
    :meth:`sync` (at start, and whenever DNS discovery changes the pool) subscribes to every
    node that lists an events endpoint and forgets nodes that left, with their keys."""

    def __init__(self, pool: Pool, salt: bytes, max_keys: int = 1 << 20) -> None:
        """``salt``: the deployment secret's ``KeyUse.EVENTS`` key (events publish salted keys)."""
        self.pool, self.salt, self.max_keys = pool, salt, max_keys
        self.holders: OrderedDict[bytes, set[str]] = OrderedDict()     # stored longest ago first
        self.fingerprint = b""
        self.chunk_tokens = 0
        self.events = 0
        self._announced: dict[str, tuple[bytes, int]] = {}           # node -> (fingerprint, chunk_tokens)
        self._followers = Followers(self._follow, self.forget)

    def start(self) -> None:
        self.sync()

    def sync(self) -> None:
        """Follow the pool's current nodes (needs a running event loop). Non-blocking."""
        self._followers.sync({n.url: n.events_endpoint for n in self.pool.nodes if n.events_endpoint})

    async def stop(self) -> None:
        await self._followers.stop()

    async def _follow(self, url: str, endpoint: str) -> None:
        sock = subscriber()
        sock.connect(endpoint)
        try:
            while True:
                raw = await sock.recv()
                try:
                    ev = decode_event(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("bad store event from %s: %s", endpoint, exc)
                    continue
                self.apply(url, ev)
        finally:
            sock.close(linger=0)

    def apply(self, url: str, ev: StoreEvent) -> None:
        self.events += 1
        if self._announced.get(url) != (ev.fingerprint, ev.chunk_tokens):
            self._announced[url] = (ev.fingerprint, ev.chunk_tokens)
            self._follow_majority()
        if ev.fingerprint != self.fingerprint:
            return                                   # another engine build's keys: never matched by a request
        for k in ev.keys:
            if ev.kind == "stored":
                self.holders.setdefault(k, set()).add(url)
                self.holders.move_to_end(k)
            else:
                self._drop(k, url)
        while len(self.holders) > self.max_keys:
            self.holders.popitem(last=False)

    def _follow_majority(self) -> None:
        """Index the fingerprint most current nodes announce (keys of another are dropped)."""
        if not self._announced:
            return
        (fp, chunk), _ = Counter(self._announced.values()).most_common(1)[0]
        if fp != self.fingerprint:
            if self.fingerprint:
                log.warning("cache-aware index: the prefill nodes now announce another engine fingerprint; "
                            "following it (nodes still on the old one are placed by load)")
            self.holders.clear()
            self.fingerprint, self.chunk_tokens = fp, chunk

    def forget(self, url: str) -> None:
        """A node left the pool: it holds nothing any more (and its fingerprint counts no more)."""
        for k in [k for k, held in self.holders.items() if url in held]:
            self._drop(k, url)
        if self._announced.pop(url, None) is not None:
            self._follow_majority()

    def _drop(self, key: bytes, url: str) -> None:
        if (held := self.holders.get(key)) is not None:
            held.discard(url)
            if not held:
                del self.holders[key]                # an evicted key leaves no empty entry behind

    def prefix_hits(self, token_ids: list[int]) -> dict[str, int]:
        """Per node url: how many leading full chunks of ``token_ids`` it holds (0: absent)."""
        hits: dict[str, int] = {}
        if not self.fingerprint:
            return hits
        alive: set[str] | None = None
        whole = token_ids[: len(token_ids) // self.chunk_tokens * self.chunk_tokens]
        for depth, raw in enumerate(chunk_keys_from_digest(whole, self.fingerprint, self.chunk_tokens), 1):
            key = published_key(self.salt, raw)
            alive = set(self.holders.get(key, ())) if alive is None else alive & self.holders.get(key, set())
            if not alive:
                break
            for url in alive:
                hits[url] = depth
        return hits

    def hint(self, token_ids: list[int]) -> PrefixHint:
        """The prompt's length and each node's cached leading tokens, for the pick."""
        return PrefixHint(len(token_ids), {u: h * self.chunk_tokens for u, h in self.prefix_hits(token_ids).items()})


class PromptTokenizer:
    """Tokenise request bodies the way vLLM's OpenAI server does (for key computation only):
    a completion's prompt with the tokenizer's special tokens (``add_special_tokens``, default
    true), a chat rendered by its template with the generation prompt, then encoded without them.
    A fast tokenizer is called through its Rust backend, which gives the same ids for a fraction
    of the wrapper's cost (~4 us against ~33 us for a short prompt; it is on every request's path)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError("router.tokenizer: cache-aware and decode-first routing tokenise prompts with "
                              "transformers (no torch needed): pip install 'kvrelay[router]'") from exc

        self.tok = AutoTokenizer.from_pretrained(path)
        self.backend = getattr(self.tok, "backend_tokenizer", None) if getattr(self.tok, "is_fast", False) else None

    def encode(self, text: str, special: bool) -> list[int]:
        """``text``'s ids, with the tokenizer's special tokens or without."""
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=special).ids)
        return list(self.tok(text, add_special_tokens=special).input_ids)

    def __call__(self, body: dict[str, Any]) -> list[int] | None:
        if "messages" in body:
            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            return self.encode(str(text), bool(body.get("add_special_tokens", False)))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None
