"""Resident host buffers for the chunks a push gathers.

A backend without ``capabilities.registered_layout`` (tcp, shm, ucx) sends a chunk from
one host buffer, so the push gathers the chunk's blocks into one first. A fresh
``torch.empty`` per chunk is fresh anonymous memory: the gather's first write into
each page faults it in and the kernel zeroes it. Measured on the 2-vCPU development
box, gathering a 2 MiB chunk into a fresh buffer took 0.46-0.72 ms (~250 page faults),
into a buffer already resident 0.04-0.06 ms - about half a millisecond of CPU per chunk
that the push took from the prefill node's answer on the same cores.

:class:`StagingPool` lends chunk-sized buffers and takes them back when their write is
done, so after its first few pushes a prefill node gathers into memory already faulted
in. It never blocks and never refuses: with every buffer lent (more chunks in flight
than ``slots``) :meth:`StagingPool.take` returns a fresh tensor, as before - a lane
waiting here for another lane's writes would let one slow decode node stall the others.

A buffer whose write was cancelled may still be read by the backend (a socket send in
progress), so :meth:`StagingPool.retire` drops it instead of lending it again; the pool
makes a new one when it next runs short. Buffers are made on demand (``torch.zeros``:
resident from the start), so a node that never gathers (nixl) holds none.

Thread-safe: every lane of a prefill worker shares one pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvrelay.common import numa

STAGING_BYTES = 64 << 20      # at most this much is kept (at least MIN_SLOTS buffers)
MIN_SLOTS = 2


@dataclass
class Staged:
    """One lent buffer: ``tensor`` is ``[L, n, bytes_per_block]`` uint8 over the front of ``slot``."""

    tensor: torch.Tensor
    slot: torch.Tensor | None     # None: a one-off allocation, not the pool's


@dataclass(frozen=True)
class StagingStats:
    slots: int        # buffers the pool may keep
    made: int         # buffers it holds now, free or lent (a retired one no longer counts)
    free: int         # buffers ready to lend
    lent: int         # buffers out now
    reused: int       # takes served from a buffer lent before
    misses: int       # takes served by a one-off allocation (every buffer was out)


def staging_slots(slot_bytes: int, max_model_len: int, chunk_tokens: int) -> int:
    """Buffers to keep: two maximal prompts' chunks, within STAGING_BYTES, at least MIN_SLOTS."""
    per_prompt = -(-max_model_len // chunk_tokens)
    return max(MIN_SLOTS, min(2 * per_prompt, STAGING_BYTES // max(slot_bytes, 1)))


class StagingPool:
    """Up to ``slots`` host buffers of ``slot_bytes`` each, lent out and taken back."""

    def __init__(self, slot_bytes: int, slots: int, numa_node: int | None = None) -> None:
        """``numa_node``: where each buffer's pages live (:mod:`kvrelay.common.numa`; None: first touch)."""
        self.slot_bytes, self.slots, self.numa_node = slot_bytes, slots, numa_node
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._made = self._lent = self._reused = self._misses = 0

    def take(self, shape: tuple[int, int, int]) -> Staged:
        """A ``[L, n, bytes_per_block]`` uint8 buffer (contents undefined). Never blocks."""
        nbytes = shape[0] * shape[1] * shape[2]
        if nbytes > self.slot_bytes:
            raise ValueError(f"a {nbytes}-byte chunk does not fit a {self.slot_bytes}-byte staging slot")
        with self._lock:
            slot = self._free.pop() if self._free else None
            if slot is not None:
                self._reused += 1
            elif self._made < self.slots:
                self._made += 1
            else:
                self._misses += 1
                return Staged(torch.empty(shape, dtype=torch.uint8), None)
            self._lent += 1
        if slot is None:
            slot = torch.empty(self.slot_bytes, dtype=torch.uint8)
            numa.bind(slot.data_ptr(), self.slot_bytes, self.numa_node)   # before its pages exist
            slot.zero_()                                                  # every page resident now
        return Staged(slot[:nbytes].view(shape), slot)

    def give_back(self, staged: Staged) -> None:
        """The write of ``staged`` is done: lend it again."""
        if staged.slot is None:
            return
        with self._lock:
            self._lent -= 1
            self._free.append(staged.slot)

    def retire(self, staged: Staged) -> None:
        """The write of ``staged`` was cancelled and may still read it: never lend it again."""
        if staged.slot is None:
            return
        with self._lock:
            self._lent -= 1
            self._made -= 1                   # room for a new buffer in its place

    def stats(self) -> StagingStats:
        with self._lock:
            return StagingStats(self.slots, self._made, len(self._free), self._lent, self._reused, self._misses)
