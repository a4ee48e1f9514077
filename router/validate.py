"""Requests the router does not split or transfer for: vLLM judges them itself.

The router rewrites the prefill copy of a request (``max_tokens=1``, no stream, no
``stream_options``), so a field that D would reject but P would accept would cost a whole
prefill and a push for nothing - and an error the router wrote itself would not read as
vLLM's. Such a request goes to a decode node *alone* (no prefill node, no transfer), which
answers it exactly as one vLLM would: the same status, the same error body. This module
says which:

* ``max_tokens`` / ``max_completion_tokens``: not absent, null or an integer >= 1;
* ``stream``: not a boolean; ``stream_options`` without ``stream: true``;
* chat ``messages``: not a non-empty list; ``prompt``: neither a string nor token ids.

Several sequences (``n``, ``best_of``), lists of prompts and multimodal content also go to
a decode node alone, but because they would share one transfer (:func:`kvrelay.router.split.decode_only_reason`).
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


def _prompt_ok(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt)


def check(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why ``body`` must be judged by vLLM itself on a decode node alone (None: it can go the PD way)."""
    for key in ("max_tokens", "max_completion_tokens"):
        if (why := _positive_int_or_null(body, key)) is not None:
            return why
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return f"'stream' must be a boolean, got {stream!r}"
    if body.get("stream_options") is not None and not stream:
        return "'stream_options' is only allowed when 'stream' is true"
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
    elif not _prompt_ok(body.get("prompt")):
        return "'prompt' must be a string, token ids or a list of them"
    return None
