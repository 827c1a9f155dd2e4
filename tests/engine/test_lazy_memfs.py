"""The lazy memory file over a real FUSE mount (no VM; root): its bytes are the assembled
image's, and after the first read of a window the rest of that window is in the kernel
page cache (notify_store), so reading a neighbouring page does not reach the server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.engine.lazy.chunks import open_local
from forkd.engine.lazy.layout import ImageLayout
from forkd.errors import ForkdError
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE
from forkd.store.store import Store
from forkd.synthetic import write_base

pyfuse3 = pytest.importorskip("pyfuse3")
trio = pytest.importorskip("trio")
from forkd.engine.lazy import memfs  # noqa: E402  (needs pyfuse3)

SIZE = 4 * CHUNK_SIZE


class CountingFile(memfs.MemoryFile):
    """The memory file, counting the reads that reach it."""

    reads: list[tuple[int, int]]

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.reads.append((off, size))
        return await super().read(fh, off, size)


@contextlib.contextmanager
def _serving(ops: CountingFile, mnt: Path) -> Iterator[Path]:
    """``ops`` mounted at ``mnt`` and served (with its page-cache pusher) until the end."""
    mnt.mkdir()
    memfs.mount(ops, str(mnt))
    tokens: list[object] = []

    async def main() -> None:
        tokens.append(trio.lowlevel.current_trio_token())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.push_windows)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    try:
        yield mnt / memfs.FILE_NAME
    finally:
        deadline = time.monotonic() + 60  # the mount's thread died first: fail, not hang
        while not tokens:
            assert time.monotonic() < deadline and thread.is_alive(), "the FUSE loop never ran"
            time.sleep(0.01)
        trio.from_thread.run_sync(pyfuse3.terminate, trio_token=tokens[0])
        thread.join(30)
        pyfuse3.close(unmount=True)
    assert memfs.our_mounts(str(mnt)) == []


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[CountingFile, Path, bytes]]:
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    store = Store(tmp_path / "home")
    image = tmp_path / "base.img"
    write_base(image, SIZE, seed=7, random_share=0.5)
    store.import_layer("app:v1", memory=image)
    ops = CountingFile(ImageLayout(open_local(store, "app:v1"), "memory"))
    ops.reads = []
    with _serving(ops, tmp_path / "mnt") as path:
        yield ops, path, image.read_bytes()


def test_a_first_read_pushes_its_window_into_the_page_cache(
        mounted: tuple[CountingFile, Path, bytes]) -> None:
    ops, path, want = mounted
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, PAGE_SIZE, 0) == want[:PAGE_SIZE]
        deadline = time.monotonic() + 30
        while ops.pushed < 1:
            assert time.monotonic() < deadline, "the first window never reached the page cache"
            time.sleep(0.01)
        before = len(ops.reads)
        far = memfs.STORE_WINDOW - 4 * PAGE_SIZE  # past any readahead of the first read
        assert os.pread(fd, PAGE_SIZE, far) == want[far : far + PAGE_SIZE]
        assert ops.reads[before:] == [], "a page of a pushed window reached the server"
        other = memfs.STORE_WINDOW + 8 * PAGE_SIZE  # a window nobody read: served by a read
        assert os.pread(fd, PAGE_SIZE, other) == want[other : other + PAGE_SIZE]
        assert len(ops.reads) > before
    finally:
        os.close(fd)


def test_a_pushed_chunk_is_read_from_the_page_cache(
        mounted: tuple[CountingFile, Path, bytes]) -> None:
    """push_chunk (the prefetch, as each memory chunk arrives): every page of the chunk is
    in the page cache, so reading them reaches the server not once."""
    ops, path, want = mounted
    os.stat(path)  # the kernel knows the inode now
    ops.cache_ready.set()
    digest = next(iter(ops.layout.by_chunk))
    assert ops.push_chunk(digest, ops.layout.source.read(digest))
    assert ops.pushed_digests == {digest}
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, piece in ops.layout.placed(digest, ops.layout.source.read(digest)):
            got = os.pread(fd, len(piece), offset)
            assert got == want[offset : offset + len(piece)]
    finally:
        os.close(fd)
    assert ops.reads == [], "a page of a pushed chunk reached the server"


def test_the_first_read_of_a_window_fills_its_holes(tmp_path: Path) -> None:
    """A read of a page no layer provides (free guest memory) puts the window's other
    zero pages into the page cache before it is answered: reading them later reaches the
    server not once, and they read as zeros; a page with data there still reads right."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    store = Store(tmp_path / "home")
    image = tmp_path / "sparse.img"
    data = bytearray(2 * memfs.STORE_WINDOW)
    data[8 * PAGE_SIZE : 9 * PAGE_SIZE] = os.urandom(PAGE_SIZE)  # one page with data
    image.write_bytes(bytes(data))
    store.import_layer("sparse:v1", memory=image)
    ops = CountingFile(ImageLayout(open_local(store, "sparse:v1"), "memory"))
    ops.reads = []
    with _serving(ops, tmp_path / "mnt") as path:
        fd = os.open(path, os.O_RDONLY)
        try:
            hole = 200 * PAGE_SIZE  # far from the data page and from any readahead
            assert os.pread(fd, PAGE_SIZE, hole) == bytes(PAGE_SIZE)
            before = len(ops.reads)
            for page in (0, 100, 400, 511):
                assert os.pread(fd, PAGE_SIZE, page * PAGE_SIZE) == bytes(PAGE_SIZE)
            assert ops.reads[before:] == [], "a zero page of a filled window reached the server"
            assert os.pread(fd, PAGE_SIZE, 8 * PAGE_SIZE) == data[8 * PAGE_SIZE : 9 * PAGE_SIZE]
        finally:
            os.close(fd)


def test_recorded_windows_get_their_holes_before_any_read(tmp_path: Path) -> None:
    """A read that fills a window's holes is heard (on_window: what the access order
    records);
    push_zeros (a later server, for the recorded windows) puts a window's holes into the
    page cache before any read, so reading them reaches the server not once, while the
    window's page with data is still read from its chunk, unchanged."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    store = Store(tmp_path / "home")
    image = tmp_path / "sparse.img"
    data = bytearray(3 * memfs.STORE_WINDOW)
    data[8 * PAGE_SIZE : 9 * PAGE_SIZE] = os.urandom(PAGE_SIZE)  # window 0 has data
    image.write_bytes(bytes(data))
    store.import_layer("sparse:v1", memory=image)
    heard: list[int] = []
    ops = CountingFile(ImageLayout(open_local(store, "sparse:v1"), "memory"),
                       on_window=heard.append)
    ops.reads = []
    with _serving(ops, tmp_path / "mnt") as path:
        os.stat(path)
        ops.cache_ready.set()
        assert ops.push_zeros([2, 0, 99]) == 2  # 99: past this image, ignored
        fd = os.open(path, os.O_RDONLY)
        try:
            for window in (0, 2):
                for page in (0, 100, 511):
                    at = window * memfs.STORE_WINDOW + page * PAGE_SIZE
                    assert os.pread(fd, PAGE_SIZE, at) == bytes(PAGE_SIZE)
            assert ops.reads == [], "a hole of a pushed window reached the server"
            assert heard == []
            assert os.pread(fd, PAGE_SIZE, 8 * PAGE_SIZE) == data[8 * PAGE_SIZE : 9 * PAGE_SIZE]
            assert ops.reads, "the page with data was not read from its chunk"
            one = memfs.STORE_WINDOW + 300 * PAGE_SIZE  # window 1: nobody pushed it
            assert os.pread(fd, PAGE_SIZE, one) == bytes(PAGE_SIZE)
            assert heard == [1]  # window 0's holes were in already: no read filled them
        finally:
            os.close(fd)
    assert ops.push_zeros([1]) == 0  # read already: its first read filled it


def test_recorded_windows_pushed_are_bounded(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded windows come from the hub: push_zeros pushes MAX_ZERO_WINDOWS of them
    at most (a hostile order naming every window of a 1 TiB image would fill the host's
    page cache with zeros); the others are filled by their first reads, as before."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    monkeypatch.setattr(memfs, "MAX_ZERO_WINDOWS", 2)
    store = Store(tmp_path / "home")
    image = tmp_path / "sparse.img"
    image.write_bytes(bytes(4 * memfs.STORE_WINDOW))
    store.import_layer("sparse:v1", memory=image)
    ops = CountingFile(ImageLayout(open_local(store, "sparse:v1"), "memory"))
    ops.reads = []
    with _serving(ops, tmp_path / "mnt") as path:
        os.stat(path)
        ops.cache_ready.set()
        assert ops.push_zeros([3, 2, 1, 0]) == 2
        assert ops.filled_windows == {3, 2}
        fd = os.open(path, os.O_RDONLY)
        try:  # a window left out reads as zeros all the same
            assert os.pread(fd, PAGE_SIZE, 100 * PAGE_SIZE) == bytes(PAGE_SIZE)
        finally:
            os.close(fd)


# Maps the file as QEMU maps guest RAM (private, MADV_HUGEPAGE) and reads the pages named.
TOUCH = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_HUGEPAGE)
sys.stdout.buffer.write(b"".join(m[p * 4096 : p * 4096 + 4096] for p in map(int, sys.argv[2:])))
"""


def test_a_recording_reads_the_pages_touched_and_nothing_more(tmp_path: Path) -> None:
    """record_pages (record.record_touched): with the mount's read-ahead off and the
    reader's huge-page advice a no-op (as for the recording child's QEMU), a reader that
    maps the file as QEMU does and touches three pages far apart is read exactly those
    pages, one at a time; nothing else goes into the page cache (no window, no holes)."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    from forkd.engine import hugepages

    store = Store(tmp_path / "home")
    image = tmp_path / "base.img"
    write_base(image, SIZE, seed=11, random_share=0.5)
    store.import_layer("app:v1", memory=image)
    ops = CountingFile(ImageLayout(open_local(store, "app:v1"), "memory"), record_pages=True)
    ops.reads = []
    pages = [3, 700, SIZE // PAGE_SIZE - 2]
    want = image.read_bytes()
    with _serving(ops, tmp_path / "mnt") as path:
        memfs.no_read_ahead(str(tmp_path / "mnt"))
        touch = [sys.executable, "-c", TOUCH, str(path), *map(str, pages)]
        done = subprocess.run(hugepages.without_advice(touch), capture_output=True,
                              timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"".join(want[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] for p in pages)
    assert ops.pages_read == set(pages)
    assert sorted(ops.reads) == [(p * PAGE_SIZE, PAGE_SIZE) for p in pages]
    assert ops.pushed == 0 and ops.filled_windows == set()


def test_read_ahead_off_needs_a_mount() -> None:
    with pytest.raises(ForkdError, match="is not mounted"):
        memfs.no_read_ahead("/nonexistent/forkd-mnt")
