"""Backend factory: one place maps ``transport.backend`` to the two halves."""

from __future__ import annotations

from kvrelay.config import KVRelayConfig, TransportKind
from transport.backends.base import ReceiverBackend, SenderBackend


def make_receiver_backend(cfg: KVRelayConfig) -> ReceiverBackend:
    kind = cfg.transport.backend
    if kind in (TransportKind.TCP, TransportKind.SHM):
        from transport.backends.sockets import SocketReceiver

        return SocketReceiver(inline_payload=kind is TransportKind.TCP, host=cfg.transport.host,
                              port=cfg.transport.data_port)
    if kind is TransportKind.NIXL:
        from transport.backends.nixl import NixlReceiver

        return NixlReceiver(error_mode=cfg.transport.nixl_error_mode.value)
    from transport.backends.ucx import UcxReceiver

    return UcxReceiver()


def make_sender_backend(cfg: KVRelayConfig) -> SenderBackend:
    kind = cfg.transport.backend
    if kind in (TransportKind.TCP, TransportKind.SHM):
        from transport.backends.sockets import SocketSender

        return SocketSender(inline_payload=kind is TransportKind.TCP)
    if kind is TransportKind.NIXL:
        from transport.backends.nixl import NixlSender

        return NixlSender(error_mode=cfg.transport.nixl_error_mode.value)
    from transport.backends.ucx import UcxSender

    return UcxSender()
