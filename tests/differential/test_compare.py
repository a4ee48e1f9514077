"""The comparator itself: it must find real differences and forgive only event boundaries."""

from __future__ import annotations

import json

from tests.differential.compare import Answer, canonical, differences


def sse(*events: object) -> Answer:
    body = b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)
    return Answer(200, "text/event-stream", body)


def tok(text: str, finish: str | None = None, index: int = 0, **extra: object) -> dict:
    return {"id": "x", "created": 1, "choices": [{"index": index, "text": text, "finish_reason": finish, **extra}]}


def test_event_boundaries_are_forgiven_but_text_finish_and_usage_are_not():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    ref = sse(tok("a"), tok("b"), tok("c", "length"), usage, "[DONE]")
    assert differences(ref, sse(tok("ab"), tok("c", "length"), usage, "[DONE]")) == []
    assert differences(ref, sse(tok("a"), tok("bd", "length"), usage, "[DONE]"))              # text
    assert differences(ref, sse(tok("ab"), tok("c", "stop"), usage, "[DONE]"))                # finish_reason
    assert differences(ref, sse(tok("abc", "length"), {"choices": [], "usage": {}}, "[DONE]"))  # usage
    assert differences(ref, sse(tok("abc", "length"), usage))                                 # no [DONE]
    assert differences(ref, sse(tok("a"), tok("b"), tok("c", "length", stop_reason=None), usage, "[DONE]"))


def test_choices_interleave_freely_but_keep_their_own_text():
    ref = sse(tok("a", index=0), tok("x", index=1), tok("b", "length", 0), tok("y", "length", 1), "[DONE]")
    assert canonical(ref.events()) == canonical(sse(tok("x", index=1), tok("ab", "length", 0),
                                                    tok("y", "length", 1), "[DONE]").events())
    assert differences(ref, sse(tok("ax", "length", 0), tok("b", "length", 1), "[DONE]"))


def test_logprobs_within_tolerance_tokens_exactly():
    def body(lp: float, token: str) -> Answer:
        return Answer(200, "application/json", json.dumps({"choices": [{"logprobs": {
            "content": [{"token": token, "logprob": lp, "top_logprobs": [{"token": token, "logprob": lp}]}]}}]}).encode())
    assert differences(body(-0.00064078, "a"), body(-0.00064066, "a")) == []
    assert differences(body(-0.00064078, "a"), body(-0.00064078, "b"))
    assert differences(body(-0.5, "a"), body(-0.6, "a"))


def test_errors_compare_by_status_and_type():
    def err(status: int, etype: str, msg: str) -> Answer:
        return Answer(status, "application/json", json.dumps({"error": {"message": msg, "type": etype}}).encode())
    assert differences(err(400, "BadRequestError", "a"), err(400, "BadRequestError", "b")) == []
    assert differences(err(400, "BadRequestError", "a"), err(400, "invalid_request_error", "a"))
    assert differences(err(400, "BadRequestError", "a"), err(502, "BadRequestError", "a"))
    assert differences(err(400, "BadRequestError", "a"), sse(tok("a", "length"), "[DONE]"))


def test_a_chat_streams_last_event_joins_like_any_other():
    def delta(text: str, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = None
        return {"choices": [choice]}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}
    ref = sse(role, delta("a"), delta("b"), delta("c", "length"), "[DONE]")
    assert differences(ref, sse(role, delta("a"), delta("bc", "length"), "[DONE]")) == []
    assert differences(ref, sse(delta("abc", "length"), "[DONE]"))                 # the role event is missing
