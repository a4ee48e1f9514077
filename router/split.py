"""First token from the prefill node (``router.first_token: prefill``).

The prefill node computes the prompt and samples token 1 anyway. The router asks it for
that token (``max_tokens=1``, ``return_token_ids``), sends it to the client at once, and
asks the decode node to continue from *prompt + token 1* as a token-id completion
(``max_tokens - 1``). D then recomputes nothing but token 1's own KV, and the transfer
runs while token 1 is on its way to the client. An answer that ends at token 1 (EOS, a
stop token, ``max_tokens=1``) never touches D.

The client sees exactly what one vLLM emits, ids and timestamps aside: the same SSE event
shapes in the same order (chat: the role event, then content deltas), ``finish_reason``
and ``stop_reason`` from whoever ended the answer, and usage counted against the
client's prompt (D's prompt is one token longer).

Anything that cannot be split this way exactly falls back, per request, to the decode
path (:func:`fallback_reason`): fields outside :data:`SPLITTABLE` - logprobs, echo,
suffix, structured outputs / guided decoding, tools, stop strings (one could span token
1 and token 2), penalties (D would count token 1 as prompt), seeded sampling (P and D
would draw from different generators), ``min_tokens``, ``return_token_ids`` asked for
by the client, continuous usage stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

# Keys a request may carry and still be split; any other key present falls back.
_COMMON = {"model", "stream", "max_tokens", "temperature", "top_p", "top_k", "min_p", "user", "ignore_eos",
           "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids",
           "priority", "request_id", "add_special_tokens", "truncate_prompt_tokens", "stream_options"}
SPLITTABLE = {
    "completions": _COMMON | {"prompt"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "add_generation_prompt", "chat_template",
                       "chat_template_kwargs", "documents", "mm_processor_kwargs"},
}
# A key set to the value that turns its feature off splits like an absent one (vLLM's own
# benchmark client sends ``repetition_penalty: 1.0``; SDKs send zero penalties, ``n: 1``):
# P gets it as sent, D gets vLLM's default, which is the same value.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "n": (1,),
    "best_of": (1,), "echo": (False,), "logprobs": (False,), "min_tokens": (0,), "stop": ([], ""),
    "stop_token_ids": ([],), "use_beam_search": (False,), "include_stop_str_in_output": (False,),
}
# Sampling keys D gets from the client's request (the rest are prompt-side or handled here).
_TO_DECODE = ("model", "temperature", "top_p", "top_k", "min_p", "user", "ignore_eos", "skip_special_tokens",
              "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "priority")


_KINDS: dict[type, tuple[type, ...]] = {int: (int, float), float: (float,), bool: (bool,), list: (list,), str: (str,)}


def _neutral(key: str, value: Any) -> bool:
    """``value`` turns ``key``'s feature off: equal to a :data:`NEUTRAL` value and of its kind
    (True is not a neutral ``n``, 0 is not a neutral ``echo``; 1.0 is a neutral penalty like 1)."""
    return any(value == n and type(value) in _KINDS[type(n)] for n in NEUTRAL.get(key, ()))


def kind(endpoint: str) -> str:
    return "chat" if endpoint.endswith("/chat/completions") else "completions"


def fallback_reason(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why ``body`` must take the decode path (None: it can be split)."""
    extra = sorted(k for k, v in body.items()
                   if k not in SPLITTABLE[kind(endpoint)] and v is not None and not _neutral(k, v))
    if extra:
        return f"fields {extra}"
    opts = {k: v for k, v in (body.get("stream_options") or {}).items() if k != "include_usage" and v}
    if opts:
        return f"stream_options {sorted(opts)}"
    temperature = body.get("temperature")
    if temperature is not None and temperature < 0:
        return "temperature < 0"
    return None


def max_new(endpoint: str, body: dict[str, Any]) -> int | None:
    """The client's output-token budget (None: it sent none)."""
    value = body.get("max_completion_tokens") if kind(endpoint) == "chat" else None
    value = body.get("max_tokens") if value is None else value
    return int(value) if value is not None else None


# vLLM's completion request defaults max_tokens to 16 (its pydantic default); a chat request
# without a budget runs to the context limit.
COMPLETION_DEFAULT_MAX_TOKENS = 16
_PARSER_FLAGS = ("--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice")


def answer_budget(endpoint: str, body: dict[str, Any], prompt_len: int, limit: int | None) -> int:
    """How many tokens the whole answer may have, decided as one vLLM decides it; 0 or less:
    one vLLM refuses the request (prompt + budget over the context limit).

    ``limit``: the decode node's ``max_model_len`` (None: unknown - a chat request without a
    budget must then not be split; see :func:`needs_limit`)."""
    asked = max_new(endpoint, body)
    if asked is None and kind(endpoint) == "completions":
        asked = COMPLETION_DEFAULT_MAX_TOKENS
    if asked is None:                                  # chat: up to the context limit
        assert limit is not None, "needs_limit() said this request needs the context limit"
        return limit - prompt_len
    if limit is not None and prompt_len + asked > limit:
        return 0
    return asked


def needs_limit(endpoint: str, body: dict[str, Any]) -> bool:
    """The answer's length depends on the context limit (a chat request with no budget)."""
    return kind(endpoint) == "chat" and max_new(endpoint, body) is None


def parsers_configured(engine_args: list[str], declared: bool) -> bool:
    """The engines rewrite chat answers (a reasoning or tool-call parser): then chat is never
    split - D's continuation is a plain completion that no parser would see."""
    return declared or any(a.split("=", 1)[0] in _PARSER_FLAGS for a in engine_args)


def decode_only_reason(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why ``body`` goes to a decode node alone (no prefill node, no transfer, no store key):
    several sequences or prompts would share one transfer, and a multimodal prompt's chunk keys
    would not name its images. One vLLM answers it as it would answer the client."""
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and not _neutral(key, value):
            return f"{key}={value!r}"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
        return "a list of prompts"
    if kind(endpoint) == "chat" and _multimodal(body.get("messages")):
        return "multimodal content"
    if "prompt_embeds" in body or "multi_modal_data" in body:
        return "multimodal or embedded prompt"
    return None


def _multimodal(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") not in ("text", None)
                                             for p in content):
            return True
    return False


@dataclass(frozen=True)
class FirstToken:
    """What the prefill node answered: token 1 and everything needed to continue."""

    answer: dict[str, Any]           # P's response (a template for the client's answer)
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    prompt_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def parse(cls, endpoint: str, answer: dict[str, Any]) -> FirstToken:
        """Raises (KeyError, TypeError, ValueError) when the answer cannot be continued as text:
        no token ids, or a chat answer a reasoning or tool parser rewrote (no ``content``)."""
        choice = answer["choices"][0]
        chat = kind(endpoint) == "chat"
        if chat:
            message = choice["message"]
            if not isinstance(message.get("content"), str) or any(
                    message.get(k) for k in ("reasoning_content", "reasoning", "tool_calls", "function_call")):
                raise ValueError("a parser rewrote token 1 (no plain content)")
        return cls(answer, choice["message"]["content"] if chat else choice["text"], list(choice["token_ids"]),
                   list(answer["prompt_token_ids"] if chat else choice["prompt_token_ids"]),
                   int(answer["usage"]["prompt_tokens"]), choice.get("finish_reason"), choice.get("stop_reason"))

    def ends_answer(self, budget: int) -> bool:
        return self.finish_reason == "stop" or budget <= 1


def prefill_body(body: dict[str, Any], *, token_ids: bool = True) -> dict[str, Any]:
    """The request P computes: the client's, for one token, not streamed. ``token_ids``: the
    split path continues from P's token, so its ids come back; the decode path discards P's
    token, so P's copy carries no seed (it needs no sampler state)."""
    # a constraint on the answer's length cannot hold for one token (vLLM refuses min_tokens >
    # max_tokens with a 400, and D would then wait first_chunk_s for a push that never comes)
    pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    pbody.update(max_tokens=1, stream=False)
    if token_ids:
        pbody["return_token_ids"] = True
    else:
        pbody.pop("seed", None)
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    return pbody


def decode_body(body: dict[str, Any], first: FirstToken, budget: int) -> dict[str, Any]:
    """D continues from prompt + token 1 as a token-id completion, streamed with usage and each
    piece's token ids (so another node can take over: :mod:`kvrelay.router.migration`), with an
    explicit budget: the answer's (:func:`answer_budget`) less token 1 (if P gave it) - never vLLM's
    completion default, which would cut a chat answer short."""
    dbody: dict[str, Any] = {k: body[k] for k in _TO_DECODE if k in body}
    dbody.update(prompt=first.prompt_token_ids + first.token_ids, stream=True, return_token_ids=True,
                 stream_options={"include_usage": True}, max_tokens=budget - len(first.token_ids))
    return dbody


def usage(first: FirstToken, decoded: int) -> dict[str, int]:
    """Usage as one vLLM counts it: the client's prompt, token 1 (if P gave it) plus D's tokens."""
    completion = len(first.token_ids) + decoded
    return {"prompt_tokens": first.prompt_tokens, "total_tokens": first.prompt_tokens + completion,
            "completion_tokens": completion}


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


_HOLE = "\x1fkvrelay-text\x1f"          # stands for a token's text in a rendered event


class StreamWriter:
    """Renders the client's SSE events in vLLM's shapes (``completions`` or ``chat``)."""

    def __init__(self, endpoint: str, first: FirstToken, with_usage: bool) -> None:
        self.chat = kind(endpoint) == "chat"
        self.with_usage = with_usage     # the fingerprint then rides on the usage event, not the last token
        a = first.answer
        self.head = {"id": a["id"], "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": a["created"], "model": a["model"]}
        self.fingerprint = a.get("system_fingerprint")
        # A token that ends nothing is this event with its text put in: render it once, around a hole
        self._around = sse(self._event(_HOLE, None, None)).split(orjson.dumps(_HOLE))
        assert len(self._around) == 2

    def opening(self) -> bytes:
        """Chat streams start with the assistant's role (as vLLM's do); completions with nothing."""
        if not self.chat:
            return b""
        return sse({**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": None, "prompt_text": None})

    def token(self, text: str, finish_reason: str | None = None, stop_reason: Any = None) -> bytes:
        if finish_reason is None:                # the hot path: one per streamed token
            return orjson.dumps(text).join(self._around)
        return sse(self._event(text, finish_reason, stop_reason))

    def _event(self, text: str, finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None}
        event: dict[str, Any] = {**self.head, "choices": [choice]}
        if finish_reason is not None and not self.with_usage:
            event["system_fingerprint"] = self.fingerprint
        return event

    def usage(self, counts: dict[str, int]) -> bytes:
        return sse({**self.head, "choices": [], "usage": counts, "system_fingerprint": self.fingerprint})


def final_answer(endpoint: str, first: FirstToken, text: str, finish_reason: str | None, stop_reason: Any,
                 decoded: int) -> dict[str, Any]:
    """The client's non-streamed answer: P's response with the whole text, reasons and usage."""
    answer = orjson.loads(orjson.dumps(first.answer))
    choice = answer["choices"][0]
    if kind(endpoint) == "chat":
        choice["message"]["content"] = first.text + text
        answer["prompt_token_ids"] = None
    else:
        choice["text"] = first.text + text
        choice["prompt_token_ids"] = None
    choice.update(finish_reason=finish_reason, stop_reason=stop_reason, token_ids=None)
    answer["usage"].update(usage(first, decoded))
    return answer


def decode_events(chunk: bytes, pending: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Split D's SSE bytes into events (JSON objects); returns (events, the unfinished tail)."""
    data = pending + chunk
    *complete, rest = data.split(b"\n\n")
    events = []
    for raw in complete:
        raw = raw.strip()
        if raw.startswith(b"data: ") and raw != b"data: [DONE]":
            events.append(orjson.loads(raw[6:]))
    return events, rest
