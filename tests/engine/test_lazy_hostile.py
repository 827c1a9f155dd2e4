"""Hostile review of the lazy-fork client side (round 1): a hostile hub or pack author, and
what a killed lazy fork leaves behind, against the real chunk source, prefetch and store
(no VM).

* A chunk whose stored bytes match the digest its map names but whose content does not
  match the map's blake3 (a hostile pack author's map) could reach the store unchecked
  (the fork command's ``WorkingSetFetch`` stores chunks by digest only, as does a pull
  killed between its fetch and its check); the server's prefetch counted such a chunk as
  here and tagged the chain: a pack that ``forkd pull`` refuses became a local tag that
  forks and pushes on. The prefetch now checks the content of every chunk of the chain
  it has not decoded itself before it tags, and tags nothing when one fails.
* The lazy memory file is mounted ``allow_other`` (each QEMU reads it after it drops to
  ``nobody``) without ``default_permissions``, and its ``open`` took any caller: any
  local user, or any other sandbox's QEMU (all run as ``nobody``), who reached the mount
  point could read a snapshot's memory; only the directories above it stood in the way.
  ``open`` now refuses a caller that is neither the server's user nor root (QEMU opens it
  as root, before its drop: its reads go on).
* A working set is bounded in stored bytes (256 MiB), not in what they decode to: 2 MiB
  of one repeated byte is stored in a few dozen. The server kept every streamed chunk's
  decoded bytes until the stream ended (each claim's future holds its result), and pinned
  each memory chunk's until its page-cache push, which waits for the file's lookup: a
  pack of such chunks with a working set naming them had each lazy fork's server hold
  thousands of 2 MiB buffers (a TiB from 256 MiB) and die of it, with the host's memory.
  A chunk that arrived is no longer held by its claim, and at most ``HANDING`` decoded
  chunks wait for their push (a chunk past that goes unpushed: reads produce its pages).
* A lazy server killed (SIGKILL, the OOM killer) left its FUSE mount behind, dead: every
  access to it fails (ENOTCONN), so every later server of that snapshot failed at its
  mount point and no lazy fork of it started on the host until someone unmounted it by
  hand. A server that holds the directory's lock now unmounts a mount of ours left there
  (no live server can hold it) before it mounts.
* The fork command streams the working set (up to 256 MiB, the hub's word) into the
  server's spool from the moment the order names it, before the chain's room check
  (open_remote's check_room, which does not count the spool either): a spool could take
  the store's disk past its reserve. The spooler now refuses a blob that cannot fit
  there (NoRoom, written as its end) before a byte of it is written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
from hostile_hub import HostileHub
from hostile_packs import chunk, layer, repeated_memory
from test_store_room import small  # noqa: F401  (a tmpfs with 8 MiB past the reserve)

from forkd import digest as dg
from forkd.engine.lazy import prefetch, workingset
from forkd.engine.lazy.chunks import ChunkSource, Hub, open_local, open_remote
from forkd.engine.lazy.fork import start_server
from forkd.engine.lazy.layout import ImageLayout
from forkd.engine.lazy.spool import Spooler, done_path
from forkd.pack.accessorder import WORKING_SET
from forkd.pack.imagemap import CHUNK_PAGES, CHUNK_SIZE, ImageMap
from forkd.pack.manifest import Descriptor
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.store.blobs import free_space
from forkd.store.store import Store
from forkd.synthetic import write_base

TAG = "evil/app:v1"


def _lying_pack(hub_store: Store) -> tuple[str, str]:
    """A one-layer pack on ``hub_store`` whose second chunk's map names the blake3 of other
    bytes than the chunk holds: (head manifest digest, that chunk's digest)."""
    good, good_blob = chunk([(0, CHUNK_PAGES)], 1)
    bad, bad_blob = chunk([(CHUNK_PAGES, 4)], 2)
    bad = replace(bad, blake3=dg.blake3_of(b"not these pages"))
    imap = ImageMap("flat", 2 * CHUNK_PAGES * 4096, (good, bad))
    pack = layer("app:v1", imap, {good.digest: good_blob, bad.digest: bad_blob})
    for data in (pack.manifest, *pack.blobs.values()):
        hub_store.blobs.put_bytes(data)
    return pack.digest, bad.digest


def test_a_chunk_stored_unchecked_is_checked_before_the_chain_is_tagged(
        tmp_path: Path) -> None:
    """The fork command brings a recorded chunk into the store by its digest alone (its
    content is checked when read); the server's prefetch then finds it local. Before: it
    tagged the chain ("done") with a chunk whose content the map refuses in it. Now: the
    prefetch fails naming the chunk, and no tag is made."""
    hub_store = Store(tmp_path / "hub")
    head, bad = _lying_pack(hub_store)
    fresh = Store(tmp_path / "fresh")
    with HostileHub(hub_store, {"v1": head}) as hostile, \
            RegistryClient(hostile.hub) as client:
        remote = parse_remote(f"{hostile.hub.host}/evil/app:v1")
        command = open_remote(fresh, remote, client)
        assert command.fetch_into_store(bad)  # WorkingSetFetch, in the fork command
        assert fresh.blobs.has(bad)
        server = ChunkSource(fresh, fresh.chain(head, TAG), TAG, Hub(client, remote.name))
        progress = prefetch.Progress()
        prefetch.run(server, prefetch.plan(server, [bad], list(server.refs)), 1, progress,
                     tmp_path / "prefetch.json", TAG)
        server.close()
    assert TAG not in fresh.tags.read()
    assert progress.state == "failed" and bad in (progress.error or ""), progress


NOBODY = 65534
# run as nobody, with the mount's directory open as fd argv[1] (no path above it to
# traverse: the test's own directories are private)
_OTHER_USER_READS = """
import os, sys
try:
    fd = os.open("memory.img", os.O_RDONLY, dir_fd=int(sys.argv[1]))
except PermissionError:
    sys.exit(13)
sys.stdout.buffer.write(os.pread(fd, 4096, 0))
"""


def test_another_user_cannot_open_the_lazy_memory_file(tmp_path: Path) -> None:
    """A process of another user (nobody: what every child QEMU runs as) that can reach the
    mount point opens the memory file: before, it read the snapshot's memory; now the open
    is refused (EACCES), while the server's own user (root, as QEMU opens it) still reads."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    from test_lazy_memfs import CountingFile, _serving

    store = Store(tmp_path / "home")
    image = tmp_path / "base.img"
    write_base(image, 4 << 20, seed=9, random_share=1.0)
    store.import_layer("app:v1", memory=image)
    ops = CountingFile(ImageLayout(open_local(store, "app:v1"), "memory"))
    ops.reads = []
    want = image.read_bytes()[:4096]
    with _serving(ops, tmp_path / "mnt") as path:
        with path.open("rb") as f:  # the server's user (root)
            assert f.read(4096) == want
        mount = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
        try:
            other = subprocess.run(
                ["/usr/bin/python3", "-I", "-c", _OTHER_USER_READS, str(mount)],
                user=NOBODY, group=NOBODY, extra_groups=[], pass_fds=(mount,),
                capture_output=True, timeout=60, cwd="/", check=False,
                env={"PATH": "/usr/bin"})
        finally:
            os.close(mount)
    read = "its memory" if other.stdout == want else other.stderr[-300:]
    assert other.returncode == 13, f"another user opened the memory file and read {read!r}"
    assert other.stdout == b""


def test_a_working_set_of_tiny_chunks_holds_a_bounded_decoded_size(tmp_path: Path) -> None:
    """A working set of chunks that each decode to 2 MiB of one byte (a few dozen stored
    bytes each), streamed from the spool while the page-cache push waits (as it does for
    the file's lookup): before, the server held every chunk decoded (96 x 2 MiB here) until
    the stream ended; now at most the LRU, ``HANDING`` chunks waiting for their push and the
    checkers' own, and every chunk still arrives."""
    count = 96
    publisher = repeated_memory(tmp_path / "publisher", "ws:v1", count)
    head = publisher.resolve("ws:v1")
    fresh = Store(tmp_path / "fresh")
    with HostileHub(publisher, {"v1": head}) as hostile, RegistryClient(hostile.hub) as client:
        open_remote(fresh, parse_remote(f"{hostile.hub.host}/ws/app:v1"), client)
    source = ChunkSource(fresh, fresh.chain(head, TAG), TAG, cached_chunks=2)
    order = ImageLayout(source, "memory").chunk_order
    assert len(order) == count and all(source.ref(d).stored < 4096 for d in order)
    blob = b"".join(publisher.blobs.read(d, source.ref(d).stored) for d in order)
    spool = tmp_path / "ws.spool"
    spool.write_bytes(blob)
    (tmp_path / "ws.spool.done").write_text("")
    descriptor = Descriptor(WORKING_SET, dg.of_bytes(blob), len(blob))
    lookup = threading.Event()  # the first push waits for it, as push_chunk for cache_ready
    handed: list[str] = []

    def push(digest: str, data: bytes) -> None:
        lookup.wait(3)  # nobody sets it: the file is "looked up" 3 s on
        lookup.set()
        handed.append(digest)

    tracemalloc.start()
    try:
        brought = workingset.fetch(source, descriptor, order, push, set(order), spool)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        source.close()
    assert sorted(brought) == sorted(order)
    held = 2 + workingset.HANDING + workingset.CHECKERS + 4  # chunks (4: the one being read)
    assert peak < held * CHUNK_SIZE, f"{peak / CHUNK_SIZE:.0f} decoded chunks held at once"
    assert handed and len(handed) <= count


def test_a_killed_servers_dead_mount_does_not_stop_the_next_server(tmp_path: Path) -> None:
    """SIGKILL a real lazy server (no VM): its mount stays, dead. Before, the next server
    of the snapshot failed at its mount point (HostError: did not start); now it serves the
    same bytes, and its mount is the only one left."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount with allow_other needs root and /dev/fuse")
    from forkd.engine.lazy.memfs import our_mounts

    store = Store(tmp_path / "home")
    image = tmp_path / "base.img"
    write_base(image, 4 << 20, seed=11, random_share=1.0)
    store.import_layer("app:v1", memory=image)
    want = image.read_bytes()[:4096]
    source = open_local(store, "app:v1")
    under = str(tmp_path)
    try:
        first = start_server(store, source, None, None, prefetch=False)
        os.kill(first.pid, signal.SIGKILL)
        _wait_gone(first.pid)
        assert len(our_mounts(under)) == 1  # left behind, dead
        second = start_server(store, source, None, None, prefetch=False)
        with second.memory.open("rb") as f:
            assert f.read(4096) == want
        assert len(our_mounts(under)) == 1
        _wait_gone(second.pid)  # it exits once its file is closed (LINGER)
        assert our_mounts(under) == []
    finally:
        for point in our_mounts(under):
            subprocess.run(["umount", "-l", point], check=False)


def _wait_gone(pid: int) -> None:
    from forkd.engine.qemu import pid_alive

    for _ in range(1200):
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"lazy server {pid} still runs")


def test_a_working_set_spool_that_cannot_fit_is_refused_before_a_byte(
        tmp_path: Path, small: Path) -> None:  # noqa: F811
    """A 32 MiB working set spooled where 8 MiB are free past the store's reserve: before,
    all of it was written (the reserve eaten); now the spool ends at once, saying why, and
    the filesystem has every byte it had."""
    hub_store = Store(tmp_path / "hub")
    blob = os.urandom(32 << 20)
    digest = hub_store.blobs.put_bytes(blob)
    spool = small / "lazy" / "working-set.spool"
    spool.parent.mkdir()
    free = free_space(small)
    with HostileHub(hub_store, {}) as hostile, RegistryClient(hostile.hub) as client:
        spooler = Spooler(client, "evil/app", Descriptor(WORKING_SET, digest, len(blob)), spool)
        spooler.wait(120)
    assert "needs 32.0 MiB" in done_path(spool).read_text()
    assert spool.stat().st_size == 0
    assert free_space(small) >= free - (64 << 10)  # the spool's and its end's inodes
