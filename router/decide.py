"""Decode-first placement (``router.decode_first``): which decode node, and is a prefill node needed.

1. Tokenise the prompt as vLLM does (:class:`~kvrelay.router.cache_index.PromptTokenizer`).
2. Choose D by the work it would do for this prompt: prompt tokens its prefix cache lacks
   (:class:`~kvrelay.router.kv_index.KVIndex`, from its KV events) plus its load, priced by
   ``router.load_weight`` (queued prompt tokens, and ``router.decode_request_tokens`` per
   request it is already serving). A conversation's next turn lands where its history is
   unless that node is busier than the history is worth.
3. If D would compute at most ``router.disagg_min_tokens`` it serves the request alone
   (:attr:`RoutePath.DECODE_ONLY`): no prefill node, no push, no split. A decode node with
   no request in flight stalls nobody by computing a prompt, so for it the bound is
   ``router.disagg_min_tokens_idle``: as long as D alone answers no slower than a prefill
   node plus the push (both measured by ``kvrelay calibrate``) - unless requests often
   arrive while D is busy (:class:`ArrivalOverlap`, ``router.disagg_idle_overlap``): then
   the next one would likely arrive during that prefill and wait for it. Otherwise a prefill
   node is chosen by what its own cache and the store hold against its load
   (:attr:`RoutePath.DISAGGREGATED`), and it pushes only the chunks D lacks (D names the
   chunks it holds in its pull, :mod:`kvrelay.prefill.pusher`).

Everything here is a hint: a stale index or an unknown prompt costs a worse choice, never a
wrong answer (the engine computes whatever it does not hold). With no events at all the
choice is by load alone, and the decision by prompt length alone.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.router_config import RouterConfig
from kvrelay.router.kv_index import KVIndex
from kvrelay.router.pools import Node, Pool, PrefixHint

log = logging.getLogger("kvrelay.router")


def switched_on(rc: RouterConfig) -> tuple[bool, str]:
    """Whether this router places decode-first, and why. ``router.decode_first`` true or false
    decides; auto (None, the default) is on where the router follows the engines' KV events
    (``router.kv_events`` or ``router.kv_events_port``: ``kvrelay up`` and ``deploy k8s`` set
    them) and can tokenise prompts (``router.tokenizer``, and transformers installed)."""
    if rc.decode_first is not None:
        return rc.decode_first, f"router.decode_first is {str(rc.decode_first).lower()}"
    if not (rc.kv_events or rc.kv_events_port):
        return False, "auto: the router follows no engine's KV events (router.kv_events, router.kv_events_port)"
    if not rc.tokenizer:
        return False, "auto: no router.tokenizer (the model path) to tokenise prompts with"
    if importlib.util.find_spec("transformers") is None:
        return False, "auto: transformers is not installed (pip install 'kvrelay[router]')"
    return True, "auto: the router follows the engines' KV events"


def announce_switch(rc: RouterConfig) -> bool:
    """:func:`switched_on`, logged at start: a warning where the events are wired yet it is off."""
    on, why = switched_on(rc)
    meant = rc.decode_first is None and bool(rc.kv_events or rc.kv_events_port)
    log.log(logging.WARNING if meant and not on else logging.INFO, "decode_first: %s (%s)", "on" if on else "off", why)
    return on


INLINE_CHARS = 2048          # requests up to this size are tokenised without a thread
_ITEM = 16                   # what each list item or dict entry counts, on top of its strings


def _size(value: Any, limit: int = INLINE_CHARS) -> int:
    """A bound on the work of rendering and tokenising ``value`` (a request body): the
    characters of every string in it, keys and roles included, and ``_ITEM`` per list item or
    dict entry - counted only up to just past ``limit`` (the walk stops there), so sizing a
    huge body is itself cheap: 200k empty messages or an 8 MiB role cost a few hundred steps."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += _ITEM * len(v)
            stack.extend(itertools.islice(itertools.chain.from_iterable(v.items()), 2 * (limit // _ITEM + 1)))
        elif isinstance(v, list | tuple):
            total += _ITEM * len(v)
            stack.extend(v[:limit // _ITEM + 1])
    return total


class RoutePath(str, enum.Enum):
    """Where a request went (``kvrelay_router_decisions_total{path}``)."""

    DISAGGREGATED = "disaggregated"     # a prefill node computed the prompt and pushed its KV
    DECODE_ONLY = "decode_only"         # decode_first: little left to compute, D alone
    DECODE_REQUIRED = "decode_required" # a request only D may judge or serve (n > 1, invalid fields, ...)
    NO_PREFILL = "no_prefill"           # no healthy prefill node: D alone


@dataclass(frozen=True)
class Placement:
    decode: Node
    path: RoutePath
    prompt_tokens: int          # 0: unknown (not tokenised)
    held: Mapping[str, int] = field(default_factory=dict)   # per engine URL (both pools): leading tokens cached
    token_ids: tuple[int, ...] = ()

    @property
    def decode_held(self) -> int:
        """Leading prompt tokens D's cache holds (by the index)."""
        return self.held.get(self.decode.url, 0)

    @property
    def decode_work(self) -> int:
        return self.prompt_tokens - self.decode_held


class ArrivalOverlap:
    """Per decode node, the share of its recent requests that arrived while it was busy: an
    exponential average over about ``1 / weight`` arrivals. Counted in arrivals, not time, so a
    client that sends one request at a time (its next arrives after its answer) reads 0 at any
    pace, and open traffic reads about the chance that the next request lands on a busy node."""

    def __init__(self, weight: float = 1 / 16) -> None:
        self.weight = weight
        self._share: dict[str, float] = {}

    def note(self, url: str, busy: bool) -> float:
        """Count one arrival at ``url``; the share after it."""
        old = self._share.get(url, 0.0)
        self._share[url] = share = old + self.weight * (float(busy) - old)
        return share

    def __len__(self) -> int:
        return len(self._share)

    def keep(self, urls: set[str]) -> None:
        """Forget nodes outside ``urls`` (they left the pool)."""
        for url in [u for u in self._share if u not in urls]:
            del self._share[url]


class DecodeFirst:
    """Chooses D, then the path, from one index over both pools."""

    def __init__(self, cfg: RouterConfig, prefill: Pool, decode: Pool, index: KVIndex,
                 tokenize: Callable[[dict[str, Any]], list[int] | None],
                 overlap: ArrivalOverlap | None = None) -> None:
        self.cfg, self.prefill, self.decode, self.index, self._tokenize = cfg, prefill, decode, index, tokenize
        self.overlap = overlap or ArrivalOverlap()

    async def tokens(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as vLLM computes them (None: not tokenisable). Small requests are
        tokenised on the event loop (~0.1 ms for 256 tokens: less than a thread hand-off); any
        larger one, however its size is spread (long roles, many messages), in a thread."""
        try:
            if _size(body) <= INLINE_CHARS:
                return self._tokenize(body)
            return await asyncio.to_thread(self._tokenize, body)
        except Exception as exc:  # noqa: BLE001 - a prompt we cannot tokenise is routed by load alone
            log.info("decode_first: cannot tokenise the request (%s); routing by load", exc)
            return None

    def place(self, ids: list[int] | None, model: object = None) -> Placement:
        """D and the path for a prompt of ``ids`` (None: unknown; raises NoHealthyNode) asked of
        ``model`` (a LoRA adapter's name keys its blocks apart from the base model's)."""
        if not ids:
            node = self.decode.pick(load_weight=self.cfg.load_weight)
            return Placement(node, RoutePath.DISAGGREGATED, 0)
        # one pass over the prompt's block keys for every engine; the prefill pick reuses it
        held = self.index.held(ids, (n.url for pool in (self.decode, self.prefill) for n in pool.nodes),
                               self.index.adapter_of(model))
        node = self.decode.pick(hint=PrefixHint(len(ids), held), load_weight=self.cfg.load_weight,
                                request_tokens=self.cfg.decode_request_tokens)
        limit = self._limit(node)
        path = RoutePath.DECODE_ONLY if len(ids) - held.get(node.url, 0) <= limit else RoutePath.DISAGGREGATED
        return Placement(node, path, len(ids), held, tuple(ids))

    def _limit(self, node: Node) -> int:
        """Prompt tokens ``node`` may compute alone for this arrival (counted in its overlap)."""
        idle = node.outstanding == 0 and node.pending_tokens == 0
        share = self.overlap.note(node.url, not idle)
        if len(self.overlap) > 4 * len(self.decode.nodes):
            self.overlap.keep({n.url for n in self.decode.nodes})
        if idle and share <= self.cfg.disagg_idle_overlap:
            return self.cfg.disagg_min_tokens_idle
        return self.cfg.disagg_min_tokens

    def prefill_hint(self, placement: Placement, store: PrefixHint | None) -> PrefixHint | None:
        """Per prefill node: the leading tokens its own cache or the store (``store``) holds."""
        if not placement.token_ids:
            return store
        held = {n.url: placement.held[n.url] for n in self.prefill.nodes if n.url in placement.held}
        for url, n in (store.cached_tokens.items() if store else ()):
            held[url] = max(held.get(url, 0), n)
        return PrefixHint(placement.prompt_tokens, held)
