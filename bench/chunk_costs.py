#!/usr/bin/env python3
"""What checking and decoding a pack's chunks costs this host's CPU, next to copying the
same bytes once into fresh memory (the baseline, measured in the same run): the work a
lazy server does for each working-set chunk before a child may read it (issue 14;
docs/engine.md, "On a slower host").

For up to ``--chunks`` chunk blobs of a store (zstd frames of 1 MiB or more decoded, as
the store keeps them), each figure is the least CPU time (time.process_time) of three
passes over all of them, per MiB decoded:

- **copy**: the decoded bytes copied into a fresh buffer (allocation, page faults, one
  write pass): the floor of any decoder that produces new memory;
- **sha256 of the blob** (what a fetched blob is checked by), **zstd decode**
  (forkd.pack.chunking.decompress, bounded by the size) and **blake3 of the content**
  (forkd.digest.blake3_of: what the chunk's map names);
- **lz4 decode** (block format, default and high-compression level 9), only where the
  `lz4` package is installed (it is not a forkd dependency): what a faster codec would
  save, and what it would cost in bytes fetched.

Not a pass/fail test; the machine is shared, so one run is one sample.

    python3 -P bench/chunk_costs.py --store ~/.local/share/forkd [--chunks 105] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zstandard

from forkd import digest as dg
from forkd.pack.chunking import decompress

MIB = 1 << 20


def chunk_blobs(store: Path, most: int) -> list[tuple[bytes, int]]:
    """Up to ``most`` zstd chunk blobs of the store (with their decoded size), picked at
    random among those of 1 MiB or more decoded (memory and disk chunks)."""
    paths = [p for p in (store / "blobs" / "sha256").glob("*/*") if p.is_file()]
    random.Random(1).shuffle(paths)
    found: list[tuple[bytes, int]] = []
    for path in paths:
        blob = path.read_bytes()
        try:
            size = zstandard.get_frame_parameters(blob).content_size
        except zstandard.ZstdError:
            continue  # a manifest, a map, device state: not a chunk
        if MIB <= size <= 64 * MIB:
            found.append((blob, size))
            if len(found) == most:
                break
    return found


def least_cpu(work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True, help="a forkd store (its home)")
    parser.add_argument("--chunks", type=int, default=105,
                        help="how many chunks (a langgraph-react working set is 105)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    blobs = chunk_blobs(args.store, args.chunks)
    if not blobs:
        print(f"no zstd chunk blobs under {args.store}/blobs/sha256: give the home of a "
              "store that holds a pack (forkd pull, or --publisher-home of "
              "bench/lazy_fork.py)", file=sys.stderr)
        return 2
    decoded = [decompress(blob, size, "chunk") for blob, size in blobs]
    mib = sum(len(d) for d in decoded) / MIB
    ms_per_mib: dict[str, float] = {
        "copy": least_cpu(lambda: [bytes(bytearray(d)) for d in decoded]),
        "sha256 of the blob": least_cpu(lambda: [hashlib.sha256(b).digest() for b, _ in blobs]),
        "zstd decode": least_cpu(lambda: [decompress(b, s, "chunk") for b, s in blobs]),
        "blake3 of the content": least_cpu(lambda: [dg.blake3_of(d) for d in decoded]),
    }
    sizes = {"zstd": sum(len(b) for b, _ in blobs) / MIB}
    try:
        import lz4.block  # type: ignore[import-not-found]
    except ImportError:
        lz4 = None
    if lz4 is not None:
        for name, kwargs in (("lz4", {}), ("lz4hc-9", {"mode": "high_compression",
                                                        "compression": 9})):
            packed = [lz4.block.compress(d, store_size=False, **kwargs) for d in decoded]
            sizes[name] = sum(len(p) for p in packed) / MIB

            def unpack(packed: list[bytes] = packed) -> list[bytes]:
                return [lz4.block.decompress(p, uncompressed_size=len(d))
                        for p, d in zip(packed, decoded, strict=True)]

            ms_per_mib[f"{name} decode"] = least_cpu(unpack)
    figures = {name: 1000 * seconds / mib for name, seconds in ms_per_mib.items()}
    if args.json:
        print(json.dumps({"chunks": len(blobs), "decoded_mib": mib, "stored_mib": sizes,
                          "ms_per_decoded_mib": figures}, indent=2))
        return 0
    print(f"{len(blobs)} chunks, {mib:.1f} MiB decoded; stored as "
          + ", ".join(f"{name} {n:.1f} MiB" for name, n in sizes.items()))
    copy = figures["copy"]
    for name, ms in figures.items():
        print(f"  {name:24} {ms:6.2f} ms/MiB  {ms / copy:5.2f}x copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
