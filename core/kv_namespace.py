"""A request's KV namespace: what, besides the engine, changes the KV of its prompt.

Two requests with the same prompt on the same engine have the same KV unless they run
different weights. Today that is the LoRA adapter: an adapter's q/k/v projections change
every layer's K and V. :func:`kv_namespace` names a request's adapter by its name *and* a
digest of its files, so

* the store never serves one adapter's KV to another adapter or to the base model (nor an
  adapter's old weights after it was replaced under the same name);
* a prefill and a decode node that disagree on an adapter's weights compute different
  transfer keys, so the decode node discards the pushed chunks and recomputes.

The base model's namespace is ``b""``: its keys are the engine fingerprint's own
(:func:`kvrelay.common.keys.scoped_digest`).

:func:`opaque_prompt` is the other half of the same question: a request whose prompt token
ids do not name its KV (images, audio, prompt embeddings) gets no key at all; its engine
computes it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.kvrelay.adapters")

_MAX_ADAPTER_BYTES = 4 << 30       # an adapter directory larger than this is digested by size and ends


def kv_namespace(request: Any) -> bytes:
    """``b""`` for the base model, else ``lora:<name>:<digest of the adapter's files>``."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return b""
    name = str(getattr(lora, "lora_name", "") or getattr(lora, "name", ""))
    path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", ""))
    return f"lora:{name}:{adapter_digest(path)}".encode()


def adapter_digest(path: str) -> str:
    """A digest of every regular file under an adapter directory (names and contents), re-read
    when a file's size or modification time changes. ``"unknown:<path>"`` when it cannot be
    read (a hub id vLLM resolved itself): still distinct per adapter, never shared with the base."""
    root = Path(path).expanduser()
    try:
        stamp = tuple((str(f.relative_to(root)), st.st_size, st.st_mtime_ns)
                      for f in sorted(root.rglob("*")) if f.is_file() and (st := f.stat()))
    except OSError as exc:
        log.warning("adapter %s: cannot read its files (%s); keyed by its path alone", path, exc)
        return f"unknown:{path}"
    if not stamp:
        return f"unknown:{path}"
    return _digest(str(root.resolve()), stamp)


@lru_cache(maxsize=256)
def _digest(root: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    total = 0
    for rel, size, _mtime in stamp:
        h.update(f"{rel}\x1f{size}\x1f".encode())
        total += size
        if total > _MAX_ADAPTER_BYTES:
            continue
        with open(os.path.join(root, rel), "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()[:32]


def opaque_prompt(request: Any) -> bool:
    """The prompt's token ids do not name its KV: it carries images, audio or video (its token
    ids are placeholders) or prompt embeddings. Such a request is never pushed, pulled, stored
    or loaded; its engine computes it."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None
