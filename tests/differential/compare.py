"""What one answer is, and where two answers differ.

Two answers are the same when, ids, timestamps and the system fingerprint aside:

* both are errors with the same HTTP status and the same error ``type`` (messages may word
  the same refusal differently);
* or both succeeded with equal JSON bodies, field by field;
* or both streamed the same events, one by one - usage and ``finish_reason`` included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VOLATILE = ("id", "created", "system_fingerprint")


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
    want, have = ref.events(), got.events()
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


def _diff(want: Any, have: Any, where: str) -> list[str]:
    if want == have:
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
