"""Manifest bytes by digest, kept in memory (bounded, least recently used first out).

Manifests are immutable and addressed by digest, so a cached copy never goes stale; a
manifest enters the cache only after the blob store's verified read. This keeps the
hottest request of a registry (manifest GET) off the blob store and its thread hop.

Also what the catalog API learns from manifests, by digest (``ManifestSizes``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import anyio

DEFAULT_BUDGET = 32 << 20  # bytes of manifests kept


V = TypeVar("V", bytes, str)


class SizedLRU(Generic[V]):
    """Values by key, at most ``budget`` characters (or bytes) of them, least recently
    used first out; a value larger than the budget is not kept."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[str, V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: V) -> None:
        if len(value) > self.budget:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._size += len(value)
            while self._size > self.budget:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)


class ManifestCache(SizedLRU[bytes]):
    """Manifest bytes by digest."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        super().__init__(budget)


SIZES_CACHE = 16384  # manifest digests whose total size is remembered (an int each)
SIZES_PER_THREAD = 8  # digests one thread call computes before giving its place back


class ManifestSizes:
    """An int per manifest digest (the catalog API's tag size: the manifest plus every
    blob it references directly), computed once per digest: cached (bounded LRU; a
    digest names immutable bytes, so an entry never goes stale), in worker threads under
    the limiter given (the hub's fact readers, ``Hub.readers``), and a request wanting a
    digest another request is computing waits for it instead of reading it again.
    However many tags name one manifest, it is read once; however many manifests a page
    shows, the event loop only looks them up."""

    def __init__(self, limit: int = SIZES_CACHE) -> None:
        self._limit = limit
        self._items: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._computing: dict[str, anyio.Event] = {}

    def _load(
        self, compute: Callable[[str], int | None], digests: list[str]
    ) -> dict[str, int | None]:
        """``compute`` each digest (a worker thread); cache what it could tell (None: not
        now, e.g. a blob missing from the store: asked again next time)."""
        out = {d: compute(d) for d in digests}
        with self._lock:
            for d, size in out.items():
                if size is not None:
                    self._items[d] = size
            while len(self._items) > self._limit:
                self._items.popitem(last=False)
        return out

    async def many(
        self,
        compute: Callable[[str], int | None],
        digests: Iterable[str],
        limiter: anyio.CapacityLimiter,
    ) -> dict[str, int | None]:
        """The size of each digest: cached, else ``compute``d in a thread under ``limiter``
        (``SIZES_PER_THREAD`` at a time, so other requests get turns)."""
        wanted = list(dict.fromkeys(digests))
        found: dict[str, int | None] = {}
        while len(found) < len(wanted):
            todo: list[str] = []
            waiting: list[anyio.Event] = []
            with self._lock:
                for d in wanted:
                    if d in found:
                        continue
                    size = self._items.get(d)
                    if size is not None:
                        self._items.move_to_end(d)
                        found[d] = size
                    elif d in self._computing:
                        waiting.append(self._computing[d])
                    else:
                        todo.append(d)
                mine = {d: anyio.Event() for d in todo}
                self._computing.update(mine)
            try:
                for start in range(0, len(todo), SIZES_PER_THREAD):
                    batch = todo[start : start + SIZES_PER_THREAD]
                    found.update(
                        await anyio.to_thread.run_sync(self._load, compute, batch, limiter=limiter)
                    )
            finally:
                with self._lock:
                    for d, event in mine.items():
                        del self._computing[d]
                        event.set()
            for event in waiting:  # another request computes these: then take them cached
                await event.wait()
        return found
