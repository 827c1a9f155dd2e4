"""Which chunks' content this store has checked, so a chunk is decoded to check it once.

A chunk blob is named by the sha256 of its stored (compressed) bytes; the map that names
it also declares what it decodes to (its size and blake3). ``forkd pull`` and ``forkd
load`` (``fetch.fetch_chain``) and a lazy server (``engine/lazy``) check that claim by
decoding the chunk, within its size, and hashing what comes out. Before this record every
pull decoded every chunk of the chain, those it already had too: pulling ``+sklearn`` on
a host that holds ``+pandas`` decoded their whole shared base again, as did every lazy
fork's prefetch before it tagged.

The record is an empty file ``checked/<sha256 hex>.<blake3 hex>.<size>`` in the store's
home, made once a check passed. It states a fact of the blob's bytes (those bytes decode
to that content), true for as long as the blob is intact, and an intact blob is what
every read of one checks (its sha256). A map that names the same chunk with another
blake3 or size (a lying map) finds no record, and its chunk is checked as before. A lost
record costs one check again; ``gc`` removes the records of the blobs it removes.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from forkd import digest as dg
from forkd.pack.imagemap import ChunkRef

HEX = re.compile(r"[0-9a-f]{64}")


class CheckedChunks:
    """The records of one store (``HOME/checked``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def has(self, ref: ChunkRef) -> bool:
        """Whether ``ref``'s chunk was checked to decode to what ``ref`` declares."""
        path = self._path(ref)
        return path is not None and path.exists()

    def add(self, ref: ChunkRef) -> None:
        """Record that ``ref``'s chunk decoded to what it declares (call after the check).
        Best effort: a record that cannot be written costs a check later, nothing else."""
        path = self._path(ref)
        if path is None:
            return
        with contextlib.suppress(OSError):
            try:
                _touch(path)
            except FileNotFoundError:  # the first record of this store
                self.root.mkdir(mode=0o700, exist_ok=True)
                _touch(path)

    def prune(self, kept: Iterable[str]) -> int:
        """Remove the records of chunks whose digest is not in ``kept`` (the blobs gc
        keeps); the number removed."""
        keep = {d.split(":", 1)[-1] for d in kept}
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.name.split(".", 1)[0] not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def _path(self, ref: ChunkRef) -> Path | None:
        """The record's file, or None for a ref whose names cannot be a file name (a map's
        values are validated when it is parsed: this holds even if one is not)."""
        digest = ref.digest.removeprefix(f"{dg.ALGORITHM}:")
        if not (HEX.fullmatch(digest) and HEX.fullmatch(ref.blake3)
                and isinstance(ref.size, int) and ref.size >= 0):
            return None
        return self.root / f"{digest}.{ref.blake3}.{ref.size}"


def _touch(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
