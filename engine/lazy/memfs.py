"""The memory image as a FUSE file (pyfuse3) whose pages are produced on first access.

One mount per snapshot holds one read-only file, ``memory.img``; children map it
``share=off`` (MAP_PRIVATE), as they map an assembled image. A read asks the image
layout (``layout.ImageLayout``) for its bytes, which come from the chain's chunks
(``chunks.ChunkSource``: the local store, else the hub). The kernel page cache stays on
(no ``direct_io``, ``keep_cache`` on every open): a page read once is shared by every
child of the snapshot, and a page no child touches is never produced.

A read that cannot be served (the chunk is missing and the hub is gone, or it failed
verification) answers EIO: the kernel sends the faulting QEMU SIGBUS and it dies, the
other children live on. The failure is recorded against the process that opened the
file (``errors``: pid → message naming the chunk), so the engine reports it with the
dead child. Open files are counted (``users``): the server exits when none is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pyfuse3
import trio

from forkd.engine.lazy.chunks import ChunkUnavailable
from forkd.engine.lazy.layout import ImageLayout
from forkd.engine.lazy.paths import FILE_NAME
from forkd.errors import ForkdError
from forkd.pack.accessorder import WINDOW_BYTES
from forkd.pack.imagemap import PAGE_SIZE

FILE_INODE = pyfuse3.ROOT_INODE + 1
ATTR_TIMEOUT = 3600.0  # the file never changes
READ_THREADS = 8  # FUSE reads served at once (each may wait for the hub)
STORE_WINDOW = WINDOW_BYTES  # bytes pushed into the page cache around a first read (notify_store)
STORE_QUEUE = 64  # windows waiting to be pushed; a read past that pushes nothing
CACHE_READY_WAIT = 30.0  # seconds push_chunk waits for the file to be looked up
# recorded windows whose holes push_zeros puts into the page cache, at most (1 GiB): the
# order is the hub's word, and a hostile one listing every window of a 1 TiB image would
# have each server push a TiB of zero pages into the host's page cache
MAX_ZERO_WINDOWS = 512
ZEROS = memoryview(bytes(STORE_WINDOW))  # a window's holes are pushed from this


class MemoryFile(pyfuse3.Operations):
    """A one-file file system: ``/memory.img`` of ``layout.size`` bytes."""

    def __init__(self, layout: ImageLayout,
                 on_chunks: Callable[[list[str]], None] | None = None,
                 on_error: Callable[[], None] | None = None,
                 on_window: Callable[[int], None] | None = None,
                 record_pages: bool = False) -> None:
        """on_chunks: hears of the chunks each read needs; on_window: of each window
        whose holes a read fills (its first read, unless push_zeros was first);
        on_error: called once a failed read is recorded in ``errors``, before the reader
        gets its EIO (so whoever sees the child die finds the reason); record_pages: a
        recording (engine/lazy/record.py): each read's pages are kept in ``pages_read``
        and nothing else goes into the page cache (no window, no holes), so with the
        mount's read-ahead off (``no_read_ahead``) the reads are the pages readers touch."""
        super().__init__()
        self.layout = layout
        self.pages_read: set[int] | None = set() if record_pages else None
        self.on_chunks = on_chunks
        self.on_window = on_window
        self.on_error = on_error
        self.users = 0  # files open (a mapping keeps its file open)
        self.opens = 0  # opens so far
        self.errors: dict[int, str] = {}  # pid of the opener → what failed
        self.last_release = time.monotonic()
        self._openers: dict[int, int] = {}  # fh → pid
        self._next_fh = 1
        self._limit = trio.CapacityLimiter(READ_THREADS)
        self._lock = threading.Lock()
        self.stored_windows: set[int] = set()  # windows pushed (or on their way) to the cache
        self.pushed = 0  # windows pushed into the page cache
        self._to_store: trio.MemorySendChannel[int] | None = None
        self._store_limit = trio.CapacityLimiter(1)
        self.read_requests = 0  # reads that reached this process (a page-cache miss each)
        self.pushed_digests: set[str] = set()  # chunks pushed whole (push_chunk)
        self.filled_windows: set[int] = set()  # windows whose holes are in the page cache
        # set once the kernel knows the file's inode (a lookup of it was answered): a
        # notify_store of an inode the kernel has not looked up fails (ENOENT)
        self.cache_ready = threading.Event()

    def push_chunk(self, digest: str, data: bytes) -> bool:
        """Put a chunk's pages (``data``: its verified uncompressed bytes) into the kernel
        page cache wherever the image uses them, so no child's fault on them reaches this
        process (the prefetch calls it as each memory chunk arrives; it waits for
        ``cache_ready``). False when they could not be pushed: the file was not looked up
        in time, or the kernel refused (its pages are then produced by reads, as before)."""
        if not self.cache_ready.wait(CACHE_READY_WAIT):
            return False
        try:
            for offset, piece in self.layout.placed(digest, data):
                # any buffer does (pyfuse3 takes its buffer; the stub says bytes): no copy
                pyfuse3.notify_store(FILE_INODE, offset, cast(bytes, piece))
        except OSError:
            return False
        with self._lock:
            self.pushed_digests.add(digest)
        return True

    def push_zeros(self, windows: list[int]) -> int:
        """Put the holes (zeros) of ``windows`` into the page cache before any read of
        them, so a child's first touches of free memory there (what it faults on outside
        the recorded chunks) cost no read at all: the prefetch's first step, for the
        windows recorded before (it waits for ``cache_ready``). A window a read reached
        already is skipped (that read fills it); the windows pushed, ``MAX_ZERO_WINDOWS``
        at most (the rest are filled by their first reads, as without an order)."""
        if not self.cache_ready.wait(CACHE_READY_WAIT):
            return 0
        pushed = 0
        for window in windows:
            if pushed >= MAX_ZERO_WINDOWS:
                break
            start = window * STORE_WINDOW
            if start >= self.layout.size:
                continue  # recorded for a larger image: advice, not a fact
            with self._lock:
                if window in self.filled_windows:
                    continue
                self.filled_windows.add(window)
            try:
                for hole, n in self.layout.holes(start, min(STORE_WINDOW,
                                                            self.layout.size - start)):
                    pyfuse3.notify_store(FILE_INODE, hole, cast(bytes, ZEROS[:n]))
            except OSError:
                return pushed  # refused: reads produce them, as before
            pushed += 1
        return pushed

    async def push_windows(self) -> None:
        """Serve forever: after a read, the rest of its ``STORE_WINDOW``-aligned window goes
        into the kernel page cache (``notify_store``) once its chunks need no fetch, so the
        neighbouring pages do not each fault into this process. Run it in the trio nursery
        that runs ``pyfuse3.main``. Pushing happens after the read is answered (the kernel
        holds the read's page locked until then)."""
        send, receive = trio.open_memory_channel[int](STORE_QUEUE)
        self._to_store = send
        async with receive:
            async for window in receive:
                await trio.to_thread.run_sync(self._push, window, limiter=self._store_limit)

    def _push(self, window: int) -> None:
        """Push the pieces of ``window``'s chunks that are here and not pushed whole
        already (its holes went in with its first read: ``_read``). A window with a chunk
        still on its way is tried again at its next read."""
        start = window * STORE_WINDOW
        size = min(STORE_WINDOW, self.layout.size - start)
        complete = True
        try:
            for at, length, segment in self.layout.pieces(start, size):
                if segment.digest in self.pushed_digests:
                    continue
                if not self.layout.source.available(segment.digest):
                    complete = False
                    continue
                pyfuse3.notify_store(FILE_INODE, start + at,
                                     self.layout.read(start + at, length))
        except (ForkdError, OSError):
            complete = False  # reads still produce its pages
        with self._lock:
            if complete:
                self.pushed += 1
            else:
                self.stored_windows.discard(window)

    def _read(self, off: int, size: int, fill_holes: bool) -> bytes:
        """The bytes of a read; fill_holes: also put the holes (zeros) of its window
        around it into the page cache before it is answered, so the guest's next faults
        there (free memory it starts to use: most of what it faults on outside the
        recorded chunks) do not come back one page at a time. Only the window's first
        reader fills, and never its own pages (the kernel holds them locked until the
        answer): another reader's locked page only makes this push wait for that reader's
        answer, which does not wait for anything."""
        data = self.layout.read(off, size)
        if fill_holes:
            window = off // STORE_WINDOW * STORE_WINDOW
            end = min(window + STORE_WINDOW, self.layout.size)
            with contextlib.suppress(OSError):  # refused: reads still produce them
                for at, length in [(window, off - window), (off + size, end - off - size)]:
                    for hole, n in self.layout.holes(at, length) if length > 0 else []:
                        pyfuse3.notify_store(FILE_INODE, hole, cast(bytes, ZEROS[:n]))
        return data

    def _queue_window(self, off: int) -> None:
        window = off // STORE_WINDOW
        with self._lock:
            if self._to_store is None or window in self.stored_windows:
                return
            self.stored_windows.add(window)
        try:
            self._to_store.send_nowait(window)
        except trio.WouldBlock:
            with self._lock:
                self.stored_windows.discard(window)

    def _attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_size, a.st_nlink = stat.S_IFDIR | 0o555, 0, 2
        elif inode == FILE_INODE:
            a.st_mode, a.st_size, a.st_nlink = stat.S_IFREG | 0o444, self.layout.size, 1
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        a.st_ino = inode
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        a.attr_timeout = a.entry_timeout = ATTR_TIMEOUT
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self._attrs(inode)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE or name != FILE_NAME.encode():
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(FILE_INODE)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if start_id == 0:
            pyfuse3.readdir_reply(token, FILE_NAME.encode(), self._attrs(FILE_INODE), 1)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        """Any open mode is accepted (QEMU opens its memory file read-write, then maps it
        private); a write is refused (no ``write`` handler: ENOSYS). Only the server's
        user and root may open it (EACCES): the mount is ``allow_other``, for the reads of
        a QEMU that dropped to another user after opening it as root, and without
        ``default_permissions`` no mode bit is checked for whoever else reaches it (any
        local user, any other sandbox's QEMU) wanting a snapshot's memory."""
        if inode != FILE_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if ctx.uid not in (0, os.getuid()):
            raise pyfuse3.FUSEError(errno.EACCES)
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._openers[fh] = ctx.pid
            self.users += 1
            self.opens += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    async def release(self, fh: int) -> None:
        with self._lock:
            self._openers.pop(fh, None)
            self.users -= 1
            self.last_release = time.monotonic()

    async def read(self, fh: int, off: int, size: int) -> bytes:
        size = max(0, min(size, self.layout.size - off))
        if size == 0:
            return b""
        self.read_requests += 1  # the trio thread only: no lock
        try:
            if self.on_chunks is not None:
                self.on_chunks(self.layout.chunks_at(off, size))
            if self.pages_read is not None:  # recording: the read's own pages, nothing more
                self.pages_read.update(range(off // PAGE_SIZE, -(-(off + size) // PAGE_SIZE)))
                data = await trio.to_thread.run_sync(self._read, off, size, False,
                                                     limiter=self._limit)
                return cast(bytes, data)
            window = off // STORE_WINDOW
            with self._lock:
                first = window not in self.filled_windows
                self.filled_windows.add(window)
            if first and self.on_window is not None:
                self.on_window(window)
            data = await trio.to_thread.run_sync(self._read, off, size, first,
                                                 limiter=self._limit)
            self._queue_window(off)
            return cast(bytes, data)
        except (ChunkUnavailable, ForkdError, OSError) as exc:
            with self._lock:
                pid = self._openers.get(fh, 0)
                self.errors[pid] = str(exc)
            if self.on_error is not None:
                self.on_error()
            raise pyfuse3.FUSEError(errno.EIO) from exc


def mount(ops: MemoryFile, mountpoint: str) -> None:
    """Mount ``ops`` at ``mountpoint`` (serve it with ``pyfuse3.main`` under trio)."""
    options = set(pyfuse3.default_options) - {"default_permissions"}
    options |= {"fsname=forkd-lazy", "subtype=forkd", "allow_other"}
    pyfuse3.init(ops, mountpoint, options)


def read_ahead_setting(mountpoint: str) -> Path:
    """The read-ahead setting of the file system mounted at ``mountpoint``
    (``/sys/class/bdi/MAJOR:MINOR/read_ahead_kb``, the numbers from /proc/self/mountinfo: a
    stat of the mount point would wait for this server, which does not serve yet)."""
    point = str(Path(mountpoint).parent.resolve() / Path(mountpoint).name)
    device = None
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == point:
                device = fields[2]
    if device is None:
        raise ForkdError(f"{point} is not mounted: no read-ahead to turn off")
    return Path("/sys/class/bdi") / device / "read_ahead_kb"


def no_read_ahead(mountpoint: str) -> None:
    """The kernel reads no more of the file mounted at ``mountpoint`` than a reader
    touches: the mount's read-ahead set to 0 (``read_ahead_setting``; root). Every lazy
    mount has it: around a page that is not in the page cache the kernel otherwise asks
    for 128 KiB, and where the working set is already in the page cache the rest of that
    window is memory no child touched, whose chunks a new host fetches from the hub
    before the faulting page is answered; the server pushes the window's chunks that are
    here after each read anyway (``_push``). A mapping QEMU advises MADV_HUGEPAGE is read
    4 MiB at a time all the same: lazy children start without the advice
    (engine/hugepages.py)."""
    setting = read_ahead_setting(mountpoint)
    try:
        setting.write_text("0")
    except OSError as exc:
        raise ForkdError(f"could not turn off read-ahead on the lazy mount {mountpoint} "
                         f"({setting}: {exc.strerror}); it needs root and a writable "
                         "/sys") from exc


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo (space, tab, newline and backslash as octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def clear_dead_mount(mountpoint: Path) -> None:
    """Unmount (lazily) a mount of ours left at ``mountpoint`` by a server that was killed
    (SIGKILL, the OOM killer): every access to it fails (ENOTCONN), so no later server
    could mount there. Call it holding the directory's server lock: no live server then
    serves that mount."""
    point = str(mountpoint.parent.resolve() / mountpoint.name)
    if point not in our_mounts(point):
        return
    done = subprocess.run(["fusermount3", "-u", "-z", point], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"a dead lazy mount at {point} (its server was killed) could not be "
                      f"unmounted: {done.stderr.strip()[:300]}; unmount it (umount -l "
                      f"{point}) and fork again")


def our_mounts(under: str = "") -> list[str]:
    """Mount points of forkd's lazy memory files (fsname forkd-lazy), below ``under``."""
    found = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "forkd-lazy":
                point = fields[1].replace("\\040", " ")
                if point.startswith(under):
                    found.append(point)
    return found
