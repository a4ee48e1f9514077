"""Eviction policies: which key goes first when a tier is full.

``lru`` evicts the least recently used key, ``lfu`` the least frequently used one
(ties: the least recently used), ``fifo`` the oldest insertion regardless of use.
``victim(evictable)`` skips keys the caller says must stay (chunks with live
references are never evicted).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable


class Policy(abc.ABC):
    @abc.abstractmethod
    def insert(self, key: bytes) -> None: ...

    @abc.abstractmethod
    def access(self, key: bytes) -> None: ...

    @abc.abstractmethod
    def remove(self, key: bytes) -> None: ...

    @abc.abstractmethod
    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict next among those ``evictable`` accepts (None if none)."""


class LRU(Policy):
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()   # oldest use first

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return next((k for k in self._order if evictable(k)), None)


class FIFO(LRU):
    def access(self, key: bytes) -> None:      # use does not change the order
        return None


class LFU(Policy):
    def __init__(self) -> None:
        self._hits: dict[bytes, int] = {}
        self._recency = LRU()

    def insert(self, key: bytes) -> None:
        self._hits[key] = 1
        self._recency.insert(key)

    def access(self, key: bytes) -> None:
        if key in self._hits:
            self._hits[key] += 1
            self._recency.access(key)

    def remove(self, key: bytes) -> None:
        self._hits.pop(key, None)
        self._recency.remove(key)

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        best: tuple[int, int, bytes] | None = None
        for rank, k in enumerate(self._recency._order):
            if evictable(k) and (best is None or (self._hits[k], rank) < best[:2]):
                best = (self._hits[k], rank, k)
        return None if best is None else best[2]


def make_policy(name: str) -> Policy:
    classes: dict[str, type[Policy]] = {"lru": LRU, "lfu": LFU, "fifo": FIFO}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; use lru, lfu or fifo")
    return classes[name]()
