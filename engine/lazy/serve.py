"""The lazy server of one snapshot: ``python3 -m forkd.engine.lazy.serve DIR`` (started by
``lazy.fork``; one per snapshot and store, shared by all its children).

``python3 -m forkd.engine.lazy.serve - SPAWN_LOG`` loads first and reads DIR from its
stdin (``fork.Spawn``: it exits on EOF), then moves its output from SPAWN_LOG to DIR's
server.log; a server forked from the lazy fork's own process (``fork.Forked``) does the
same through ``serve_when_told``.

It serves the chain's memory image as a FUSE file (``DIR/mnt/memory.img``, memfs) and
its disk as an NBD export (``$FORKD_RUN/lazy/<hex[:16]>/disk.nbd.sock``, paths.socket_dir,
nbd.py, with an empty child overlay on it: ``DIR/empty.qcow2``), both reading one
``ChunkSource`` (the store, else the hub).
It records the order readers need chunks (``order.json``), prefetches the chain at once
when an order was recorded before (the recorded working set; the rest once
``DIR/prefetch.go`` says the command's children are started), else once ``prefetch.go``
appears (or ``PREFETCH_AFTER`` seconds after it is ready), and exits when no file of its mount
is open any more (every child gone) for ``LINGER`` seconds, unmounting first. Its files in DIR:

    server.json   what to serve (written by lazy.fork before the start)
    server.lock   held by the running server
    ready.json    {pid, memory, overlay, disk}: present while it serves
    errors.json   {"<pid>": message} reads that failed, by the QEMU that read (the one
                  that opened the memory file, the peer of the NBD connection)
    prefetch.json prefetch progress (prefetch.Progress)
    pages.json    a recording's pages (record_pages: engine/lazy/record.py)
    server.log    its log
While it runs it holds the store's gc lock shared: no `forkd gc` removes the chunks it
fetched before the chain is tagged.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from forkd.engine.lazy import memfs, orders, prefetch
from forkd.engine.lazy.chunks import ChunkSource, Hub
from forkd.engine.lazy.layout import ImageLayout
from forkd.engine.lazy.nbd import DiskExport, start_disk_export
from forkd.engine.lazy.paths import FILE_NAME, MOUNT_DIR, PAGES_FILE, socket_dir
from forkd.errors import ForkdError
from forkd.pack import accessorder
from forkd.pack.accessorder import Order
from forkd.pack.imagemap import runs
from forkd.pack.manifest import Descriptor
from forkd.registry import client as registry_client
from forkd.registry import credentials
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_hub
from forkd.store.store import Store

LINGER = 1.0  # seconds with no open file before the server exits
FIRST_OPEN_GRACE = 60.0  # seconds it waits for its first open (a loaded host's forker)
LOCK_WAIT = 30.0  # seconds a new server waits for an exiting one to unmount
PREFETCH_AFTER = 5.0  # seconds after ready when the prefetch starts without a signal
POLL = 0.1
log = logging.getLogger("forkd.lazy")


@dataclass(frozen=True)
class ServerSpec:
    """What a server serves (server.json)."""

    home: str
    head: str
    name: str
    tag: str | None  # the local tag given once the chain is complete
    hub: str | None  # hub address, for missing chunks
    repo: str | None
    prefetch: bool = True  # False: fetch on demand only (no prefetch.go, no timer)
    working_set: dict[str, Any] | None = None  # the recorded chunks' blob (a descriptor)
    working_set_spool: str | None = None  # the file the fork command streams it into
    record_pages: bool = False  # a recording: the pages read kept in pages.json (record.py)

    def save(self, d: Path) -> None:
        tmp = d / "server.json.tmp"
        tmp.write_text(json.dumps(self.__dict__))
        tmp.replace(d / "server.json")

    @classmethod
    def load(cls, d: Path) -> ServerSpec:
        return cls(**json.loads((d / "server.json").read_text()))


class Server:
    def __init__(self, d: Path, spec: ServerSpec) -> None:
        self.dir = d
        self.spec = spec
        self.store = Store(Path(spec.home))
        hub = None
        if spec.hub and spec.repo:
            target = parse_hub(spec.hub)
            hub = Hub(RegistryClient(target, credentials.load(target.host)), spec.repo)
        self.source = ChunkSource(self.store, self.store.chain(spec.head, spec.name),
                                  spec.name, hub)
        self.recorded = prefetch.load_order(d / "order.json", spec.head)
        self.working_set = (Descriptor.from_json(spec.working_set, "the working set")
                            if spec.working_set is not None else None)
        self.order = prefetch.AccessOrder()
        self.memory = ImageLayout(self.source, "memory")
        self.ops = memfs.MemoryFile(self.memory, self.order.note, self.save_errors,
                                    self.order.note_window, spec.record_pages)
        self.export: DiskExport | None = None
        self.progress = prefetch.Progress()
        self.stopping = False
        self.prefetch_started = False
        self.children_started = threading.Event()  # prefetch.go, or PREFETCH_AFTER passed
        self._errors_seen = 0
        self._errors_lock = threading.Lock()

    def start_disk(self) -> Path | None:
        """Start the disk export and write its empty child overlay: the overlay's path."""
        if not any("disk" in link.manifest.maps for link in self.source.chain):
            return None
        export = start_disk_export(self.source, socket_dir(self.dir),
                                   on_access=lambda d: self.order.note((d,)))
        self.export = export
        overlay = self.dir / "empty.qcow2"
        export.create_overlay(overlay)
        return overlay

    async def watch(self) -> None:
        """Exit once nothing is open for LINGER seconds; start the prefetch; keep the
        error and order files current."""
        ready_at = time.monotonic()
        # the kernel must know the file before the prefetch can push pages into its cache
        await trio.to_thread.run_sync(os.stat, self.dir / MOUNT_DIR / FILE_NAME)
        self.ops.cache_ready.set()
        while not self.stopping:
            await trio.sleep(POLL)
            self.save_errors()
            if not self.children_started.is_set() and (
                    (self.dir / "prefetch.go").exists()
                    or time.monotonic() - ready_at > PREFETCH_AFTER):
                self.children_started.set()
                self.start_prefetch()
            idle = time.monotonic() - max(self.ops.last_release, ready_at)
            waited = self.ops.opens > 0 or time.monotonic() - ready_at > FIRST_OPEN_GRACE
            if self.ops.users == 0 and idle > LINGER and waited:
                (self.dir / "ready.json").unlink(missing_ok=True)
                await trio.sleep(0)
                if self.ops.users == 0:
                    break
                self.write_ready()  # an open raced the shutdown: serve on
        pyfuse3.terminate()

    def start_prefetch(self) -> None:
        """Start the background fetch of the chain, once (not when the spec says on demand
        only). With a recorded order it starts as the server starts (REAP): the working
        set is fetched while the children are still being started."""
        if self.prefetch_started or not self.spec.prefetch:
            return
        self.prefetch_started = True
        recorded = self.recorded
        self.save_order()
        if recorded is not None and recorded.windows:  # their holes: no fetch, no wait
            threading.Thread(target=self.ops.push_zeros, args=(recorded.windows,),
                             daemon=True).start()
        threading.Thread(target=self.prefetch, args=(recorded,), daemon=True).start()

    def prefetch(self, recorded: Order | None) -> None:
        chunks = recorded.chunks if recorded is not None else []
        plan = prefetch.plan(self.source, chunks, self.image_order())
        prefetch.run(self.source, plan, len(chunks), self.progress,
                     self.dir / "prefetch.json", self.spec.tag,
                     on_chunk=self.ops.push_chunk, handed=self.memory.by_chunk,
                     working_set=self.working_set if recorded is not None else None,
                     spool=Path(self.spec.working_set_spool)
                     if recorded is not None and self.spec.working_set_spool else None,
                     before_rest=self.after_first_steps if recorded is not None else None)
        log.info("prefetch %s in %.2f s: %d chunks fetched (%d in the working set's one "
                 "request; the recorded ones in %.2f s), %d pushed into the page cache; %s",
                 self.progress.state, self.progress.seconds, self.progress.fetched,
                 self.progress.streamed, self.progress.recorded_seconds,
                 len(self.ops.pushed_digests), self.progress.error or "")

    def after_first_steps(self) -> None:
        """With a recorded working set, the rest of the chain waits for the command's
        children to be started and to take their first steps (BACKGROUND_SETTLE): on a
        small host its fetches, checks and the hub's answers take the cores their start
        needs, and none of them needs it yet (a read of a chunk not here is fetched when
        it comes)."""
        self.children_started.wait(PREFETCH_AFTER)
        time.sleep(prefetch.BACKGROUND_SETTLE)
        self.source.open_writes()

    def image_order(self) -> list[str]:
        order = list(self.memory.chunk_order)
        if self.export is not None:
            order += ImageLayout(self.source, "disk").chunk_order
        return order

    def save_order(self) -> None:
        """Keep the order this run recorded when none was known (the first run's is the
        true demand order), and publish it next to the pack (orders.publish: best effort,
        it needs a push right on the repository)."""
        if self.recorded is not None or not self.order.digests or self.spec.record_pages:
            return
        order = self.order.recorded()
        prefetch.save_order(self.dir / "order.json", self.spec.head, order)
        self.recorded = order
        hub = self.source.hub
        if hub is not None:
            try:
                orders.publish(hub.client, hub.repo, self.spec.head,
                               accessorder.encode(self.spec.head, order))
                log.info("published the access order (%d chunks, %d memory windows) to %s",
                         len(order.chunks), len(order.windows), hub)
            except ForkdError as exc:
                log.info("the access order stays local: %s", exc)

    def save_pages(self) -> None:
        """A recording's pages (pages.json: ``{"manifest", "pages": runs}``)."""
        if self.ops.pages_read is None:
            return
        tmp = self.dir / (PAGES_FILE + ".tmp")
        tmp.write_text(json.dumps({"manifest": self.spec.head,
                                   "pages": runs(sorted(self.ops.pages_read))}))
        tmp.replace(self.dir / PAGES_FILE)

    def save_errors(self) -> None:
        """errors.json current: polled, and at once when a memory read fails (before its
        EIO kills the reading QEMU, so the fork that sees it die reads why)."""
        with self._errors_lock:
            self._save_errors()

    def _save_errors(self) -> None:
        errors: dict[str, str] = {str(pid): msg for pid, msg in dict(self.ops.errors).items()}
        for failure in self.export.failures if self.export is not None else []:
            errors.setdefault(str(failure.pid), failure.message)  # the QEMU that read it
        if len(errors) != self._errors_seen:
            self._errors_seen = len(errors)
            tmp = self.dir / "errors.json.tmp"
            tmp.write_text(json.dumps(errors))
            tmp.replace(self.dir / "errors.json")

    def write_ready(self, overlay: Path | None = None) -> None:
        tmp = self.dir / "ready.json.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(),
                                   "memory": str(self.dir / MOUNT_DIR / FILE_NAME),
                                   "overlay": str(overlay) if overlay else None,
                                   "disk": str(self.export.socket) if self.export else None}))
        tmp.replace(self.dir / "ready.json")


def warm_up() -> None:
    """Load what a server's first minutes would: a server process that waits to be told
    its directory (a spare, a ``fork.Spawn``) does this first."""
    registry_client.warm_up()


def serve(d: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per chunk
    lock = os.open(d / "server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + LOCK_WAIT
    while True:  # an exiting server of the same snapshot may still be unmounting
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.info("another server serves %s", d)
                return 0
            time.sleep(0.05)
    for name in ("ready.json", "prefetch.go", "errors.json", "prefetch.json", PAGES_FILE):
        (d / name).unlink(missing_ok=True)
    server = Server(d, ServerSpec.load(d))
    mnt = d / MOUNT_DIR
    memfs.clear_dead_mount(mnt)  # a killed server's (the lock is ours: none serves it)
    mnt.mkdir(exist_ok=True)
    with server.store.writing():
        if server.recorded is not None:  # a known working set: fetch it from now on
            server.source.hold_writes()  # into the store once the children are started
            server.start_prefetch()
        overlay = server.start_disk()
        memfs.mount(server.ops, str(mnt))
        try:
            try:
                memfs.no_read_ahead(str(mnt))
            except ForkdError as exc:
                if server.spec.record_pages:  # a recording needs each page read alone
                    raise
                log.info("%s: read-ahead stays on", exc)
            server.write_ready(overlay)
            log.info("serving %s at %s", server.spec.name, mnt)
            signal.signal(signal.SIGTERM, lambda *_: setattr(server, "stopping", True))

            async def main() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server.watch)
                    nursery.start_soon(server.ops.push_windows)
                    await pyfuse3.main()
                    nursery.cancel_scope.cancel()  # the page-cache pusher

            trio.run(main)
        finally:
            (d / "ready.json").unlink(missing_ok=True)
            server.save_order()
            server.save_pages()
            server.save_errors()
            pyfuse3.close(unmount=True)
            with contextlib.suppress(ForkdError):
                server.source.close()  # the fetched chunks into the store before the gc lock goes
            if server.export is not None:
                server.export.close()
            with contextlib.suppress(OSError):
                mnt.rmdir()
    log.info("stopped: %d reads reached the server, %d chunks were pushed into the page "
             "cache", server.ops.read_requests, len(server.ops.pushed_digests))
    return 0


def _spawned(spawn_log: Path, told: int = 0) -> Path | None:
    """The directory named on ``told`` (stdin; None at EOF); output moved to its
    server.log."""
    with os.fdopen(told, "r", closefd=told != 0) as f:
        line = f.readline().strip()
    if not line:
        spawn_log.unlink(missing_ok=True)
        return None
    d = Path(line)
    adopt_log(d, spawn_log)
    return d


def serve_when_told(told: int, spawn_log: Path) -> int:
    """What a server forked before its snapshot is known runs (``fork.Forked``): load,
    then serve the directory named on the pipe ``told`` (exit 0 at EOF)."""
    warm_up()
    d = _spawned(spawn_log, told)
    return 0 if d is None else serve(d)


def adopt_log(d: Path, loading_log: Path) -> None:
    """This process's output from ``loading_log`` (what it said while it loaded, kept) to
    ``d``'s server.log; ``loading_log`` is removed."""
    log_fd = os.open(d / "server.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
    with contextlib.suppress(OSError):
        os.write(log_fd, loading_log.read_bytes())
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    loading_log.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if argv[1] != "-":
        return serve(Path(argv[1]))
    return serve_when_told(0, Path(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
