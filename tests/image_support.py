"""Test images made by the tests: compressible, non-trivial bytes, whole chunks long."""

from __future__ import annotations

import random
from pathlib import Path

from forkd.pack.imagemap import CHUNK_SIZE

REGIONS = 4  # chunks in a text image


def text_image(path: Path, seed: int) -> bytes:
    """REGIONS chunks of random words written to ``path`` (zstd levels give different
    frames for them); the bytes written."""
    rng = random.Random(seed)
    words = [bytes(rng.choice(b"abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(400)]
    out = bytearray()
    while len(out) < REGIONS * CHUNK_SIZE:
        out += rng.choice(words) + b" "
    data = bytes(out[: REGIONS * CHUNK_SIZE])
    path.write_bytes(data)
    return data
