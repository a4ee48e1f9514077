"""`kvrelay warmup --prompts FILE`: run hot prompts through prefill nodes once so the store has them.

FILE is plain text (one prompt per line; blank lines skipped) or JSONL where each line is
``{"prompt": "..."}`` or ``{"messages": [...]}`` (chat). Each prompt goes to a prefill
node with ``max_tokens=1`` and no push target: the node computes it and its store keeps
every full chunk. The report counts prompts, prompt tokens and the chunks the node's
store accepted (from its worker metrics when ``--metrics URL`` is given, else the number
of full chunks the prompts contain).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvrelay.common.errors import ConfigError, UnreachableError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="text file (one prompt per line) or JSONL (prompt / messages)")
    p.add_argument("--url", action="append", default=[], help="prefill node URL (repeatable; default "
                   "http://127.0.0.1:8100); prompts are spread round-robin")
    p.add_argument("--model", default="kvrelay-tiny", help="served model name")
    p.add_argument("--metrics", action="append", default=[],
                   help="a prefill worker's metrics URL (connector.metrics_port) to count stored chunks exactly")
    p.add_argument("--chunk-tokens", type=int, default=256)


def read_prompts(path: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--prompts: cannot read {path}: {exc.strerror or exc}") from exc
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: invalid JSON: {exc}") from exc
            if not isinstance(obj, dict) or not ({"prompt", "messages"} & obj.keys()):
                raise ConfigError(f"{path}:{n}: expected an object with 'prompt' or 'messages'")
            items.append(obj)
        else:
            items.append({"prompt": line})
    return items


def _stored(metrics_urls: list[str]) -> float:
    total = 0.0
    for url in metrics_urls:
        text = _fetch(urllib.request.Request(url), 10)
        m = re.search(r"^kvrelay_store_chunks_stored_total (\S+)$", text.decode(), re.M)
        total += float(m.group(1)) if m else 0.0
    return total


def _fetch(req: urllib.request.Request, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data: bytes = r.read()
            return data
    except OSError as exc:                 # URLError, HTTPError, refused, timed out
        raise UnreachableError(f"{req.full_url}: {getattr(exc, 'reason', exc)}") from exc


def main(args: argparse.Namespace) -> int:
    from kvrelay.common.optional import progress_bar

    items = read_prompts(args.prompts)
    urls = args.url or ["http://127.0.0.1:8100"]
    before = _stored(args.metrics)
    tokens = full_chunks = 0
    for i, item in enumerate(progress_bar(iterable=items, desc="warmup", unit="prompt")):
        chat = "messages" in item
        body = {"model": args.model, "max_tokens": 1, "temperature": 0, **item}
        req = urllib.request.Request(f"{urls[i % len(urls)]}/v1/{'chat/' if chat else ''}completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        n = int(json.loads(_fetch(req, 600))["usage"]["prompt_tokens"])
        tokens += n
        full_chunks += n // args.chunk_tokens
    stored = float(full_chunks)
    if args.metrics:            # saves finish off the request path: wait until the count settles
        deadline, last, since = time.monotonic() + 30, -1.0, time.monotonic()
        while time.monotonic() < deadline:
            stored = _stored(args.metrics) - before
            if stored >= full_chunks or (stored == last and time.monotonic() - since > 2):
                break
            if stored != last:
                last, since = stored, time.monotonic()
            time.sleep(0.2)
    how = "stored (worker metrics)" if args.metrics else "full chunks computed (stored unless already present)"
    print(f"warmup: {len(items)} prompts, {tokens} prompt tokens, {int(stored)} chunks {how}", file=sys.stderr)
    return 0
