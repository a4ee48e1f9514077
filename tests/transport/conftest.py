"""Fixtures for the transport conformance suite.

The receiver lives in the pytest process (so tests can inspect its pool and
events); every sender is a separate, spawned process (:class:`transport.peer.SenderPeer`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvrelay.bench.peer import SenderPeer
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.core import config
from kvrelay.transport.backends import make_receiver_backend
from kvrelay.transport.pool import Placement
from kvrelay.transport.receiver import Receiver

BACKENDS = ["tcp", "shm", "nixl", "ucx"]
# ... and, where a GPU is present, nixl into a receive pool in device memory (transport.pool_device gpu)
DEVICE_POOLS = {"nixl+vram": "cuda"} if torch.cuda.is_available() else {}
FP = hashlib.sha256(b"conformance-fingerprint").digest()
SLOT = (1 << 20) + HEADER_SIZE


def make_cfg(backend: str, **over: object) -> config.KVRelayConfig:
    items = {"transport.backend": backend, "transport.pool_bytes": "16MiB",
             "timeouts.peer_s": 1.0, "timeouts.heartbeat_s": 0.1, "timeouts.lease_s": 30,
             **over}
    return config.load(overrides=[f"{k}={v}" for k, v in items.items()])


def make_receiver(cfg: config.KVRelayConfig, slot_bytes: int = SLOT, **kw: Any) -> Receiver:
    return Receiver(cfg.transport, cfg.timeouts, make_receiver_backend(cfg.transport), FP, slot_bytes=slot_bytes, **kw)


@contextlib.contextmanager
def open_pair(cfg: config.KVRelayConfig, *, sender_cfg: config.KVRelayConfig | None = None,
              sender_fp: bytes = FP, connect: bool = True, sender_secret: bytes | None = None,
              **receiver_kw: Any) -> Iterator[tuple[Receiver, SenderPeer]]:
    """A receiver here and a sender in a spawned process; both closed on exit."""
    receiver = make_receiver(cfg, **receiver_kw)
    peer = SenderPeer(sender_cfg or cfg, receiver.endpoint, sender_fp, secret=sender_secret)
    try:
        if connect:
            peer.call("connect")
        yield receiver, peer
    finally:
        peer.close()
        receiver.close()


def assert_no_leases(receiver: Receiver) -> None:
    st = receiver.pool.stats()
    assert st.leased == st.filled == st.held == 0, st
    assert st.free == st.slots


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=BACKENDS + list(DEVICE_POOLS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Receiver, SenderPeer]]:
    """A receiver here and a connected sender process, checked for leaks afterwards (every
    backend, and every pool kind the host has)."""
    backend, device = request.param.partition("+")[0], DEVICE_POOLS.get(request.param)
    with open_pair(make_cfg(backend), placement=Placement(device=device)) as (receiver, peer):
        yield receiver, peer
        assert_no_leases(receiver)


def payload_bytes(receiver: Receiver, ev: Any) -> bytes:
    """An arrival's payload as bytes, from a host slot or a slot in device memory."""
    payload = receiver.payload(ev)
    return payload.cpu().numpy().tobytes() if isinstance(payload, torch.Tensor) else bytes(payload)


def keys_for(tid: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tid}/{i}".encode()).digest() for i in range(n)]
