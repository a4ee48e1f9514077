"""Installing a landed chunk into the engine's KV cache, verified: what the decode worker does with each arrival.

A chunk's payload is ``[layer][block]``, range ``span`` of each block (a piece's heads). It
lands in a host slot (pinned pages) or, with ``transport.pool_device: gpu``, in device memory
beside the KV cache. Either way the install is the one copy, and the hash is taken over what it
wrote, so the bytes verified are exactly the bytes installed and a late write into the slot
cannot slip in between. With ``transport.data_mac`` the keyed MAC is checked the same way, over
the installed bytes (a host pool only). A mismatch raises :class:`~kvrelay.common.errors.ChecksumError`
after the blocks were written; the caller reports them for recompute, which overwrites them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.common.wire import DataMac, check_payload, check_regions, copy_checked
from kvrelay.kernels.blocks import gather_range, scatter_range
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span
from kvrelay.transport.events import ChunkArrival


def install_verified(layout: KVLayout, ev: ChunkArrival, payload: Any, targets: list[int], skip: int,
                     span: Span, mac: DataMac | None = None) -> None:
    """Install ``ev``'s payload (a host memoryview or a device tensor: the slot) into blocks
    ``targets``; its first ``skip`` blocks are ones D already held (verified, not written).
    ``mac``: check ``transport.data_mac``'s tag too (the sender's signer; host payloads only)."""
    if isinstance(payload, torch.Tensor):
        assert mac is None, "transport.data_mac needs a host receive pool (config refuses pool_device gpu)"
        _from_device(layout, ev, payload, targets, skip, span)
    else:
        _from_host(layout, ev, payload, targets, skip, span, mac)


def _from_host(layout: KVLayout, ev: ChunkArrival, payload: Any, targets: list[int], skip: int, span: Span,
               mac: DataMac | None) -> None:
    """Bytes the transport hashed as they landed (tcp) are scattered from the slot; a CPU cache
    is hashed as installed (read back), a device cache takes one private host copy, verified,
    then the scatter. A MAC is always taken over the installed bytes (or that private copy)."""
    src = torch.frombuffer(payload, dtype=torch.uint8).view(layout.num_layers, skip + len(targets), span.nbytes)
    on_cpu = layout.device.type == "cpu"
    if (not ev.verified or mac is not None) and not on_cpu:
        private = torch.empty_like(src)
        if ev.verified:
            private.copy_(src)
        else:
            copy_checked(ev.header, src.numpy().data, private.numpy().data)     # verified in its copy
        src = private
    ids = torch.tensor(targets, dtype=torch.int64)
    if len(ids):
        scatter_range(layout, ids.to(layout.device), src[:, skip:].to(layout.device), span)
    if on_cpu and (not ev.verified or mac is not None):
        regions = []                      # the payload's [layer][block] order, as installed
        for i in range(layout.num_layers):
            regions.append(src[i, :skip].numpy().data)
            regions += [row.numpy().data for b in targets for row in span.of(layout.block_view(i, b))]
        if not ev.verified:
            check_regions(ev.header, regions)
        if mac is not None:
            mac.check(ev.header, regions)
    elif mac is not None:
        mac.check(ev.header, [src.numpy().data])


def _from_device(layout: KVLayout, ev: ChunkArrival, payload: torch.Tensor, targets: list[int], skip: int,
                 span: Span) -> None:
    """Device to device, then the installed bytes read back to the host once and hashed (with
    the slot's bytes of the ``skip`` blocks D already held)."""
    src = payload.view(layout.num_layers, skip + len(targets), span.nbytes)       # [L, n, span] on the device
    ids = torch.tensor(targets, dtype=torch.int64, device=layout.device)
    if len(ids):
        scatter_range(layout, ids, src[:, skip:], span)
    if ev.verified:
        return
    back = torch.empty_like(src)
    back[:, :skip] = src[:, :skip]
    if len(ids):
        installed = torch.empty((layout.num_layers, len(ids), span.nbytes), dtype=torch.uint8, device=layout.device)
        back[:, skip:] = gather_range(layout, ids, installed, span)
    check_payload(ev.header, back.cpu().numpy().data)
