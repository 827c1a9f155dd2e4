"""The working-set spool's reader (engine/lazy/spool.py) on real files: the fork command
streams the blob into a file that the new server reads as it grows. The reader gets every
byte in order while the writer is still at work, stops with the writer's error when the
file ends short, and gives up on a writer that went silent (the spool against a real hub,
and its chunks' checks: test_lazy_chunks.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from forkd.engine.lazy import spool
from forkd.registry.client import RegistryError


def _write_slowly(path: Path, data: bytes, pieces: int, outcome: str | None) -> threading.Thread:
    """A writer that appends ``data`` in ``pieces`` steps, then ends (``outcome`` None:
    writes no end at all, as a killed command)."""
    def run() -> None:
        step = -(-len(data) // pieces)
        with open(path, "ab", buffering=0) as f:
            for at in range(0, len(data), step):
                f.write(data[at : at + step])
                time.sleep(0.02)
        if outcome is not None:
            spool.done_path(path).write_text(outcome)

    path.touch()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_reader_follows_the_writer(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    path = tmp_path / spool.SPOOL_NAME
    writer = _write_slowly(path, data, 7, "")
    got = b"".join(spool.blocks(path, len(data)))
    writer.join()
    assert got == data


def test_a_short_spool_ends_with_the_writers_error(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    path = tmp_path / spool.SPOOL_NAME
    writer = _write_slowly(path, data, 3, "the hub went away")
    seen: list[bytes] = []
    with pytest.raises(RegistryError, match=r"ended after 1048576 of 2097152 bytes: the hub"):
        for block in spool.blocks(path, 2 << 20):
            seen.append(block)
    writer.join()
    assert b"".join(seen) == data  # what it had was handed on, in order


def test_a_silent_writer_is_given_up(tmp_path: Path) -> None:
    path = tmp_path / spool.SPOOL_NAME
    writer = _write_slowly(path, b"x" * 1000, 1, None)
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match=r"no byte for 0\.3 s after 1000 of 5000"):
        list(spool.blocks(path, 5000, stall=0.3))
    writer.join()
    assert time.monotonic() - t0 < 10
