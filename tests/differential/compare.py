"""What one answer is, and where two answers differ.

Two answers are the same when, ids, timestamps and the system fingerprint aside:

* both are errors with the same HTTP status and the same error ``type`` (messages may word
  the same refusal differently);
* or both succeeded with equal JSON bodies, field by field;
* or both streamed the same events, one by one - usage and ``finish_reason`` included -
  once each stream is in canonical form (:func:`canonical`): vLLM's own API server puts
  several tokens into one event whenever its engine is ahead of it, and interleaves the
  choices of ``n`` > 1 as they come, so two runs of one vLLM differ in where events break.
  The canonical form joins consecutive deltas of one choice and orders choices by index;
  every field of every event is still compared.

Log-probabilities are compared to within :data:`LOGPROB_TOL` (relative): a decode node
computes the last prompt token in its own step over transferred KV, where float32 kernels
sum in another order than one forward over the whole prompt - the tokens, and which tokens
are the top alternatives, must still be the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VOLATILE = ("id", "created", "system_fingerprint")
LOGPROB_TOL = 1e-4
_FINAL_KEYS = {"stop_reason"}


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    @property
    def streamed(self) -> bool:
        return self.status == 200 and "text/event-stream" in self.content_type

    def events(self) -> list[Any]:
        out: list[Any] = []
        for part in self.body.split(b"\n\n"):
            part = part.strip()
            if part.startswith(b"data: "):
                data = part[6:]
                out.append("[DONE]" if data == b"[DONE]" else _strip(json.loads(data)))
        return out

    def json(self) -> Any:
        try:
            return _strip(json.loads(self.body))
        except ValueError:
            return {"<not json>": self.body[:200].decode(errors="replace")}

    def error_type(self) -> str:
        data = self.json()
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            return str(err.get("type"))
        return str(data.get("type") if isinstance(data, dict) else data)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def differences(ref: Answer, got: Answer) -> list[str]:
    """Human-readable differences of ``got`` from ``ref`` ([] = the same answer)."""
    if ref.status != 200 or got.status != 200:
        if ref.status != got.status:
            return [f"status {got.status} != {ref.status}: got {got.body[:300]!r}, want {ref.body[:300]!r}"]
        if ref.status != 200 and ref.error_type() != got.error_type():
            return [f"error type {got.error_type()!r} != {ref.error_type()!r}"]
        return []
    if ref.streamed != got.streamed:
        return [f"streamed={got.streamed} != {ref.streamed}"]
    if not ref.streamed:
        return _diff(ref.json(), got.json(), "body")
    want, have = canonical(ref.events()), canonical(got.events())
    out: list[str] = []
    for k in range(max(len(want), len(have))):
        if k >= len(want) or k >= len(have):
            extra = have[k:] if len(have) > len(want) else want[k:]
            out.append(f"{len(have)} events != {len(want)}; {'extra' if len(have) > len(want) else 'missing'}: "
                       f"{json.dumps(extra[:2])[:300]}")
            break
        out += _diff(want[k], have[k], f"event {k}")
        if len(out) > 5:
            break
    return out


def canonical(events: list[Any]) -> list[Any]:
    """A stream with each choice's consecutive deltas joined, choices in index order (see the
    module docstring). Events without choices (usage, errors, ``[DONE]``) stay where they are;
    between two of them, each choice's events come in order, the choices by index."""
    out: list[Any] = []
    segment: dict[int, list[dict[str, Any]]] = {}     # choice index -> its events since the last barrier
    for ev in events:
        choices = ev.get("choices") if isinstance(ev, dict) else None
        if not choices:
            out += [e for i in sorted(segment) for e in segment[i]]
            segment = {}
            out.append(ev)
            continue
        for choice in choices:
            mine = segment.setdefault(choice.get("index", 0), [])
            if mine and _joinable(mine[-1]["choices"][0], choice):
                _join(mine[-1]["choices"][0], choice)
            else:
                mine.append({**ev, "choices": [json.loads(json.dumps(choice))]})
    return out + [e for i in sorted(segment) for e in segment[i]]


def _joinable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``b`` only adds text (and log-probabilities) to ``a``: neither ended the choice, and b
    has no role or tool call of its own."""
    if a.get("finish_reason") is not None:
        return False
    delta = b.get("delta")
    if isinstance(delta, dict) and set(delta) - {"content", "reasoning_content"}:
        return False
    return set(a) - _FINAL_KEYS == set(b) - _FINAL_KEYS     # a chat stream's last event adds stop_reason


def _join(a: dict[str, Any], b: dict[str, Any]) -> None:
    if "text" in b:
        a["text"] = (a.get("text") or "") + (b.get("text") or "")
    if isinstance(b.get("delta"), dict):
        for k, v in b["delta"].items():
            a["delta"][k] = (a["delta"].get(k) or "") + (v or "")
    if "logprobs" in a or "logprobs" in b:
        a["logprobs"] = _join_logprobs(a.get("logprobs"), b.get("logprobs"))
    for k in ("finish_reason", "stop_reason", "token_ids", "prompt_token_ids"):
        if k in b and (b[k] is not None or k in ("finish_reason", "stop_reason")):
            a[k] = b[k]
    if "stop_reason" in a and "stop_reason" not in b and "finish_reason" in b:
        del a["stop_reason"]


def _join_logprobs(a: Any, b: Any) -> Any:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a if b is None else b
    return {k: (a.get(k) or []) + (b.get(k) or []) if isinstance(b.get(k), list) else b.get(k) for k in b}


def _close(want: Any, have: Any, where: str) -> bool:
    """Log-probabilities within tolerance (see the module docstring)."""
    if not ("logprob" in where or "top_logprobs" in where):
        return False
    if isinstance(want, float) and isinstance(have, float):
        return abs(want - have) <= LOGPROB_TOL * max(1.0, abs(want))
    if isinstance(want, dict) and isinstance(have, dict) and set(want) == set(have):
        return all(want[k] == have[k] or _close(want[k], have[k], where) for k in want)
    return False


def _diff(want: Any, have: Any, where: str) -> list[str]:
    if want == have or _close(want, have, where):
        return []
    if isinstance(want, dict) and isinstance(have, dict):
        out = []
        for key in sorted(set(want) | set(have)):
            if key not in have:
                out.append(f"{where}.{key} missing (want {json.dumps(want[key])[:120]})")
            elif key not in want:
                out.append(f"{where}.{key} unexpected ({json.dumps(have[key])[:120]})")
            else:
                out += _diff(want[key], have[key], f"{where}.{key}")
        return out
    if isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        return [d for i, (w, h) in enumerate(zip(want, have, strict=True)) for d in _diff(w, h, f"{where}[{i}]")]
    return [f"{where}: {json.dumps(have, ensure_ascii=False)[:200]} != {json.dumps(want, ensure_ascii=False)[:200]}"]
