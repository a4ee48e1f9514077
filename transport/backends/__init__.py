"""Backend factory: one place maps ``transport.backend`` to the two halves."""

from __future__ import annotations

from kvrelay.transport.backends.base import ReceiverBackend, SenderBackend
from kvrelay.transport.config import TransportConfig, TransportKind


def make_receiver_backend(cfg: TransportConfig) -> ReceiverBackend:
    kind = cfg.backend
    if kind in (TransportKind.TCP, TransportKind.SHM):
        from kvrelay.transport.backends.sockets import SocketReceiver

        inline = kind is TransportKind.TCP
        return SocketReceiver(inline_payload=inline, host=cfg.host, port=cfg.data_port,
                              advertise=cfg.advertised_host() if inline else "")
    if kind is TransportKind.NIXL:
        from kvrelay.transport.backends.nixl import NixlReceiver

        return NixlReceiver(error_mode=cfg.nixl_error_mode.value)
    from kvrelay.transport.backends.ucx import UcxReceiver

    return UcxReceiver()


def make_sender_backend(cfg: TransportConfig) -> SenderBackend:
    kind = cfg.backend
    if kind in (TransportKind.TCP, TransportKind.SHM):
        from kvrelay.transport.backends.sockets import SocketSender

        return SocketSender(inline_payload=kind is TransportKind.TCP)
    if kind is TransportKind.NIXL:
        from kvrelay.transport.backends.nixl import NixlSender

        return NixlSender(error_mode=cfg.nixl_error_mode.value)
    from kvrelay.transport.backends.ucx import UcxSender

    return UcxSender()
