"""What the router checks before any engine sees a request.

The router rewrites the prefill copy of a request (``max_tokens=1``, no stream, no
``stream_options``), so a field that D would reject but P would accept costs a whole
prefill and a push for nothing. Every field the rewrite touches, and every feature PD
cannot split, is checked here and answered with an OpenAI-style 400:

* ``max_tokens`` / ``max_completion_tokens``: absent, null or an integer >= 1;
* ``stream``: a boolean; ``stream_options`` only with ``stream: true``;
* ``n`` / ``best_of`` above 1: several sequences would share one transfer;
* a list of prompts (batch completions): one transfer per request only; a single
  prompt given as token ids is fine;
* chat ``messages``: a non-empty list.
"""

from __future__ import annotations

from typing import Any


def _positive_int_or_null(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"'{key}' must be an integer >= 1, got {value!r}"
    return None


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt)


def check(endpoint: str, body: dict[str, Any]) -> str | None:
    """The reason ``body`` cannot be served as one PD request, or None if it can."""
    for key in ("max_tokens", "max_completion_tokens"):
        if (why := _positive_int_or_null(body, key)) is not None:
            return why
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return f"'stream' must be a boolean, got {stream!r}"
    if body.get("stream_options") is not None and not stream:
        return "'stream_options' is only allowed when 'stream' is true"
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            return f"'{key}'={value!r} is not supported: disaggregated serving runs one sequence per request"
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
    elif "prompt" in body and not _single_prompt(body["prompt"]):
        return "'prompt' must be one string or one list of token ids (send batch prompts as separate requests)"
    return None
