"""A seeded generator of OpenAI requests shaped as real clients send them.

Each draw picks an endpoint (completions or chat), streaming or not, a budget or none, a
prompt (text, token ids, a list of prompts, empty, unicode, near the context limit) and
a handful of the parameters SDKs send: stop strings and token ids, ``n``, ``best_of``,
logprobs, ``echo``, seeded sampling, penalties, ``min_tokens``, ``ignore_eos``,
``response_format``, ``tools``, ``stream_options.include_usage``, and odd headers (a
300-character or non-ASCII ``X-Request-Id``).

Sampling with ``temperature > 0`` always carries a ``seed``: an unseeded draw has no
single right answer to compare against. The same ``(seed, n)`` gives the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

MODEL = "kvrelay-tiny"
TEXT = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;:!?0123456789\n"
UNICODE = "éüñ中文🙂ßø"                # outside the tiny model's alphabet: <unk> tokens
FIRST_CHAR_ID, LAST_CHAR_ID = 4, 100      # the tiny model's character token ids
# vLLM 0.32's CPU build kills its engine ("CPU Generator does not use offset") when a seeded
# request's prompt is prefilled in more than one step (over max_num_batched_tokens, 2,048
# here) - one plain vLLM as much as a kvrelay node. Seeded draws keep their prompts well
# under that, in plain ASCII (a non-ASCII character is several byte-level tokens).
SEEDED_MAX_PROMPT = 1300


@dataclass(frozen=True)
class Request:
    index: int
    path: str                                 # /v1/completions | /v1/chat/completions
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def describe(self) -> str:
        body = json.dumps(self.body, ensure_ascii=False)
        if len(body) > 600:
            body = body[:300] + f" ...[{len(body) - 600} chars]... " + body[-300:]
        heads = {k: (v if len(v) < 40 else f"{v[:20]}...({len(v)} chars)") for k, v in self.headers.items()}
        return f"#{self.index} POST {self.path} headers={heads} body={body}"


class Surface:
    """Draws requests; ``max_model_len`` sizes the near-limit prompts."""

    def __init__(self, seed: int, max_model_len: int = 4096) -> None:
        self.rng = random.Random(seed)
        self.limit = max_model_len

    def draw(self, n: int) -> list[Request]:
        return [self.one(i) for i in range(n)]

    def one(self, i: int) -> Request:
        r = self.rng
        chat = r.random() < 0.5
        body: dict[str, Any] = {"model": MODEL}
        budget = self._budget(body, chat)
        self._sampling(body)
        if chat and budget is None and "seed" in body:       # a short prompt would run ~4,000 tokens
            budget = body["max_tokens"] = r.choice([4, 12])
        if chat:
            body["messages"] = self._messages(budget, "seed" in body)
        else:
            body["prompt"] = self._prompt(budget, "seed" in body)
        if r.random() < 0.5:
            body["stream"] = True
            if r.random() < 0.6:
                body["stream_options"] = {"include_usage": True}
        self._extras(body, chat, budget)
        return Request(i, "/v1/chat/completions" if chat else "/v1/completions", body, self._headers())

    # ---------------------------------------------------------------- pieces
    def _budget(self, body: dict[str, Any], chat: bool) -> int | None:
        r = self.rng
        x = r.random()
        if x < 0.3:
            return None                                      # most SDK chat calls send none
        value = r.choice([1, 1, 2, 3, 5, 8, 12, 16, 24])
        body["max_completion_tokens" if chat and x > 0.85 else "max_tokens"] = value
        return value

    def _text(self, n: int, ascii_only: bool = False) -> str:
        r = self.rng
        if r.random() < 0.08 and not ascii_only:
            return "".join(r.choice(TEXT + UNICODE) for _ in range(n))
        return "".join(r.choice(TEXT) for _ in range(n))

    def _length(self, budget: int | None, chat: bool, seeded: bool = False) -> int:
        r = self.rng
        x = r.random()
        if seeded:                                           # see SEEDED_MAX_PROMPT
            return r.randint(5, SEEDED_MAX_PROMPT - 100)
        if budget is None and chat:                          # runs to the context limit: keep that short
            return self.limit - r.randint(40, 90)
        if x < 0.04:
            return self.limit - r.randint(1, 30)             # near the limit: vLLM may refuse
        if x < 0.10:
            return r.randint(1, 4)
        if x < 0.25:
            return r.choice([255, 256, 257, 511, 512, 513])  # chunk boundaries
        return r.randint(5, 1200)

    def _prompt(self, budget: int | None, seeded: bool) -> Any:
        r = self.rng
        n = self._length(budget, False, seeded)
        x = r.random()
        if x < 0.04:
            return ""
        if x < 0.18:
            return [r.randint(FIRST_CHAR_ID, LAST_CHAR_ID) for _ in range(n)]
        if x < 0.24:
            return [self._text(r.randint(5, 300), seeded) for _ in range(r.randint(2, 3))]
        return self._text(n, seeded)

    def _messages(self, budget: int | None, seeded: bool) -> list[dict[str, Any]]:
        r = self.rng
        n = self._length(budget, True, seeded) - 30          # the template's own tokens
        msgs: list[dict[str, Any]] = []
        if r.random() < 0.5:
            k = r.randint(5, max(5, n // 3))
            msgs.append({"role": "system", "content": self._text(k, seeded)})
            n -= k
        if r.random() < 0.3 and n > 60:                      # an earlier turn
            msgs += [{"role": "user", "content": self._text(20, seeded)},
                     {"role": "assistant", "content": self._text(20, seeded)}]
            n -= 40
        content: Any = self._text(max(1, n), seeded)
        if r.random() < 0.1:
            content = [{"type": "text", "text": content}]     # content parts, text only
        msgs.append({"role": "user", "content": content})
        return msgs

    def _sampling(self, body: dict[str, Any]) -> None:
        r = self.rng
        x = r.random()
        if x < 0.55:
            body["temperature"] = 0
        elif x < 0.85:
            body.update(temperature=r.choice([0.5, 0.8, 1.0, 1.3]), seed=r.randint(0, 2**31))
            if r.random() < 0.5:
                body["top_p"] = r.choice([0.5, 0.9])
            if r.random() < 0.3:
                body["top_k"] = r.choice([2, 5, 20])
        # else: nothing sent - vLLM's default temperature for this model (1.0 with no
        # generation config) would be unseeded: use the default only greedily
        else:
            body["temperature"] = 0.0

    def _extras(self, body: dict[str, Any], chat: bool, budget: int | None) -> None:  # noqa: C901, PLR0912
        r = self.rng

        def maybe(p: float) -> bool:
            return r.random() < p
        if maybe(0.08):
            body["stop"] = r.sample(list("aeiou .M"), r.randint(1, 2))
        if maybe(0.06):
            body["stop_token_ids"] = [r.randint(FIRST_CHAR_ID, LAST_CHAR_ID) for _ in range(2)]
        if maybe(0.05):
            body["n"] = 2
        if maybe(0.03) and not chat:
            body["best_of"] = 2
        if maybe(0.08):
            if chat:
                body.update(logprobs=True, top_logprobs=r.randint(0, 3))
            else:
                body["logprobs"] = r.randint(0, 3)
        if not chat and maybe(0.05):
            body["echo"] = True
        if maybe(0.06):
            body[r.choice(["presence_penalty", "frequency_penalty"])] = r.choice([0.5, 1.2])
        if maybe(0.04):
            body["repetition_penalty"] = r.choice([1.0, 1.15])
        if maybe(0.05) and budget is not None and budget > 1:
            body["min_tokens"] = r.randint(1, budget)
        if maybe(0.05):
            body["ignore_eos"] = True
        if maybe(0.05):
            body["response_format"] = {"type": "json_object"}
        if chat and maybe(0.05):
            body.update(tools=[{"type": "function", "function": {
                "name": "lookup", "description": "Look a word up",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}],
                tool_choice="none")
        if maybe(0.04):
            body["user"] = "user-" + str(r.randint(0, 99))
        if maybe(0.03):
            body["logit_bias"] = {str(r.randint(FIRST_CHAR_ID, LAST_CHAR_ID)): 5}

    def _headers(self) -> dict[str, str]:
        r = self.rng
        x = r.random()
        if x < 0.05:
            return {"X-Request-Id": "r" * 300}
        if x < 0.08:
            return {"X-Request-Id": "réq-ü-" + str(r.randint(0, 9999))}
        if x < 0.25:
            return {"X-Request-Id": f"client-{r.randint(0, 10**6)}"}
        return {}
