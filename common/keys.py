"""Content addressing: chained cryptographic chunk keys.

``key_i = sha256(key_{i-1} || token_ids(chunk_i) || fingerprint [bound to the request's namespace])``

Keys name shared content (multi-tenant caches), so the hash is cryptographic;
Python's ``hash()`` is never used because it is salted per process. Chaining
makes a key depend on the whole prefix, so two prompts share chunk ``i`` only
if they share every token before it. The prompt's tail (a partial chunk) gets a
key too; its token count is part of what is hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 32
ROOT_KEY = b"\x00" * KEY_BYTES


@dataclass(frozen=True)
class Fingerprint:
    """Everything that makes KV bytes incompatible between two engines.

    Two nodes may only exchange chunks when their fingerprints are equal; the
    control-plane ``Hello`` compares them. What differs per request on one engine (a LoRA
    adapter) is not here: it scopes that request's keys (:func:`scoped_digest`).
    """

    model: str
    dtype: str
    kv_layout: str          # e.g. "cpu:[blocks,heads,block_size,2*head]" or "gpu:nhd"
    block_size: int         # engine tokens per block
    num_layers: int
    bytes_per_block: int    # one layer, one block
    tp_rank: int = 0
    tp_size: int = 1
    chunk_tokens: int = 0   # tokens per chunk (a chunk of another size is other bytes under the same tokens)
    weights: str = ""       # the weights' identity: revision, or a digest of the weight files
    kv_settings: str = ""   # what else changes the KV: quantization, rope scaling, hf_overrides, KV cache dtype
    epoch: int = 0          # store.epoch: the operator's knob to retire every stored record

    def digest(self) -> bytes:
        # the "" stands where a per-engine LoRA field was: digests (and stored records) stay as they were
        fields = (self.model, self.dtype, self.kv_layout, self.block_size, self.num_layers,
                  self.bytes_per_block, self.tp_rank, self.tp_size, "", self.chunk_tokens,
                  self.weights, self.kv_settings, self.epoch)
        return hashlib.sha256("\x1f".join(map(str, fields)).encode()).digest()


def scoped_digest(fingerprint_digest: bytes, namespace: bytes = b"") -> bytes:
    """The digest a request's keys chain from: the engine's own for the base model
    (``namespace`` empty), else one bound to the request's KV namespace.

    A namespace names what changes a request's KV on the same engine: a LoRA adapter (its
    name and a digest of its weights, :func:`kvrelay.core.kv_namespace.kv_namespace`). Two
    requests share chunks only when their engines' fingerprints and their namespaces agree,
    so the store never serves one adapter's KV to another, or to the base model."""
    if not namespace:
        return fingerprint_digest
    return hashlib.sha256(b"kvrelay-namespace\x1f" + fingerprint_digest + b"\x1f" + namespace).digest()


def chunk_keys(token_ids: Sequence[int] | np.ndarray, fingerprint: Fingerprint,
               chunk_tokens: int, namespace: bytes = b"") -> list[bytes]:
    """Return one 32-byte key per chunk of ``token_ids`` (the tail included)."""
    return chunk_keys_from_digest(token_ids, fingerprint.digest(), chunk_tokens, namespace)


def chunk_keys_from_digest(token_ids: Sequence[int] | np.ndarray, fingerprint_digest: bytes,
                           chunk_tokens: int, namespace: bytes = b"") -> list[bytes]:
    """:func:`chunk_keys` from a fingerprint digest (what nodes announce to the router)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    tokens = np.asarray(token_ids, dtype="<i8")   # [n] fixed-width little-endian
    fingerprint_digest = scoped_digest(fingerprint_digest, namespace)
    keys: list[bytes] = []
    prev = ROOT_KEY
    for start in range(0, len(tokens), chunk_tokens):
        h = hashlib.sha256(prev)
        h.update(tokens[start:start + chunk_tokens].tobytes())
        h.update(fingerprint_digest)
        prev = h.digest()
        keys.append(prev)
    return keys
