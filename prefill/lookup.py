"""The scheduler's prefix lookup: how many leading prompt tokens the worker's store holds.

vLLM runs the connector's scheduler half and worker half in different processes. The
store lives in the worker (:mod:`kvrelay.prefill.store_service`), so the scheduler asks it over
a local ZeroMQ socket. A lookup that times out (``store.lookup_timeout_s``) counts as a
miss: the prompt is computed, the request never fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq

from kvrelay.common.private_files import RPC_BASE_ENV

log = logging.getLogger("vllm.kvrelay.prefill")


class Lookup(msgspec.Struct, frozen=True):
    token_ids: list[int]
    v: int = 1
    namespace: bytes = b""      # the request's KV namespace (core/kv_namespace.py)


class LookupReply(msgspec.Struct, frozen=True):
    hit_tokens: int
    v: int = 1


SLOW_LOOKUP_S = 0.1   # the worker logs lookups slower than this (the scheduler waits on them)


def lookup_endpoint(vllm_config: Any, environ: Mapping[str, str] = os.environ) -> str:
    """The engine's lookup socket, where vLLM keeps its own local sockets: ``VLLM_RPC_BASE_PATH``
    (vLLM's variable; ``kvrelay serve`` sets it to the node's private directory, which its
    supervisor removes when the node stops), else the temporary directory, as vLLM does. The
    name is short (a Unix socket's path holds 107 bytes): a digest of the engine id."""
    engine = (vllm_config.kv_transfer_config.engine_id or "default").encode()
    base = environ.get(RPC_BASE_ENV) or tempfile.gettempdir()
    return f"ipc://{base}/kvrelay-store-{hashlib.blake2b(engine, digest_size=6).hexdigest()}.sock"


def hit_limit(n_prompt: int, chunk_tokens: int) -> int:
    """Loadable prefix: whole chunks, always leaving >= 1 prompt token to compute."""
    return ((n_prompt - 1) // chunk_tokens) * chunk_tokens


class StoreClient:
    """Scheduler side. A lookup that times out counts as a miss (the prompt is computed)."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        self.endpoint, self.timeout_ms = endpoint, int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None

    def lookup(self, token_ids: list[int], namespace: bytes = b"") -> int:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        self._sock.send(msgspec.msgpack.encode(Lookup(list(token_ids), namespace=namespace)))
        if not self._sock.poll(self.timeout_ms):
            log.warning("store lookup got no answer in %.1f s (%s); computing the prompt",
                        self.timeout_ms / 1000, self.endpoint)
            self._sock.close(linger=0)
            self._sock = None
            return 0
        return msgspec.msgpack.decode(self._sock.recv(), type=LookupReply).hit_tokens

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
