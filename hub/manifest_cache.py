"""Manifest bytes by digest, kept in memory (bounded, least recently used first out).

Manifests are immutable and addressed by digest, so a cached copy never goes stale; a
manifest enters the cache only after the blob store's verified read. This keeps the
hottest request of a registry (manifest GET) off the blob store and its thread hop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_BUDGET = 32 << 20  # bytes of manifests kept


class ManifestCache:
    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> bytes | None:
        with self._lock:
            body = self._items.get(digest)
            if body is not None:
                self._items.move_to_end(digest)
            return body

    def put(self, digest: str, body: bytes) -> None:
        if len(body) > self.budget:
            return
        with self._lock:
            if digest in self._items:
                return
            self._items[digest] = body
            self._size += len(body)
            while self._size > self.budget:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)
