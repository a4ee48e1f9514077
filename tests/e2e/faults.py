"""Fault hooks the e2e tests install in a prefill node (``connector.push_hook``).

They run inside the vLLM worker process; state is per process.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

_pushed = itertools.count()
log = logging.getLogger("vllm.kvrelay.faults")


def corrupt_every_other(transfer_id: str, chunk_index: int, payload: torch.Tensor) -> torch.Tensor:
    """Flip one byte of every other pushed chunk, after its checksum was computed."""
    if next(_pushed) % 2:
        return payload
    bad = payload.clone()
    bad.view(-1)[bad.numel() // 2] ^= 0x5A
    log.warning("fault injection: corrupted chunk %d of %s", chunk_index, transfer_id)
    return bad


def slow_when_asked(transfer_id: str, chunk_index: int, payload: torch.Tensor) -> torch.Tensor:
    """Hold each chunk of a transfer whose id names a ``slowpush`` request for 0.4 s (a window
    in which to kill a node mid-transfer); every other transfer passes untouched."""
    if "slowpush" in transfer_id:
        time.sleep(0.4)
    return payload
