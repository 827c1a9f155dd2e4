"""Synthetic memory images for the demo, the tests and the benchmarks (no VM needed).

A base looks like guest memory: mostly zero pages, some random pages, some
pages repeating one pattern. A diff changes a fraction of the pages (some to
zero). Deterministic for a given seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from forkd.pack.imagemap import PAGE_SIZE

ZERO_PAGE = bytes(PAGE_SIZE)


def write_base(
    path: Path, size: int, seed: int = 0, random_share: float = 0.2, repeated_share: float = 0.1
) -> None:
    """A ``size``-byte image: ``random_share`` random pages, ``repeated_share`` of one pattern."""
    rnd = random.Random(seed)
    pattern = rnd.randbytes(PAGE_SIZE)
    with open(path, "wb") as f:
        f.truncate(size)
        for page in range(size // PAGE_SIZE):
            x = rnd.random()
            if x < random_share:
                f.seek(page * PAGE_SIZE)
                f.write(rnd.randbytes(PAGE_SIZE))
            elif x < random_share + repeated_share:
                f.seek(page * PAGE_SIZE)
                f.write(pattern)


def write_diff(parent: Path, path: Path, share: float, seed: int) -> list[int]:
    """Copy ``parent`` to ``path`` with ``share`` of its pages changed; returns those pages."""
    rnd = random.Random(seed)
    data = bytearray(parent.read_bytes())
    pages = len(data) // PAGE_SIZE
    changed = sorted(rnd.sample(range(pages), max(1, int(pages * share))))
    for page in changed:
        # One in eight changed pages becomes zero (freed memory); the rest get new bytes.
        new = ZERO_PAGE if rnd.random() < 0.125 else rnd.randbytes(PAGE_SIZE)
        data[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = new
    path.write_bytes(data)
    return changed
