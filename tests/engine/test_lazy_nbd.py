"""The disk over NBD (engine/lazy/nbd.py) against real QEMU clients (qemu-img, qemu-io) and
a raw protocol client for what QEMU never sends: the export equals the eagerly assembled
disk byte for byte, zero ranges cost no fetch, two clients at once, an overlay takes the
writes, a chunk that cannot be read fails one read with EIO, a corrupt chunk is never
served, malformed input gets an error and the server goes on. One VM test: a child whose
disk is an overlay on the export reads what the recipe wrote at build time."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hub_server import HubServer

from forkd.engine.lazy import nbd
from forkd.engine.lazy.chunks import open_local, open_remote
from forkd.engine.lazy.layout import ImageLayout
from forkd.engine.lazy.nbd import DiskExport, start_disk_export
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import push
from forkd.store.blobs import FsBlobStore
from forkd.store.store import Store

MiB = 1 << 20
DISK_SIZE = 12 * MiB
REF = "disk:v2"


def _images(tmp: Path) -> tuple[Path, Path, Path]:
    """A memory image and two disk images: a base, and a head that changes a few pages."""
    noise = os.urandom(3 * MiB + 8192)
    base = bytearray(DISK_SIZE)
    base[0 : 3 * MiB] = noise[: 3 * MiB]  # random data: two chunks
    base[5 * MiB : 5 * MiB + 8192] = b"\x01" * 8192  # two pages in a chunk of their own
    base[9 * MiB + 4096 : 9 * MiB + 12288] = noise[3 * MiB :]
    head = bytearray(base)
    head[4096:8192] = b"\x02" * 4096  # overwrites one page of the base's first chunk
    head[1 * MiB : 1 * MiB + 4096] = bytes(4096)  # becomes zero: a zero extent of the diff
    head[11 * MiB : 11 * MiB + 4096] = b"\x03" * 4096  # new data where the base had a hole
    paths = (tmp / "memory.img", tmp / "base.img", tmp / "head.img")
    paths[0].write_bytes(os.urandom(MiB) + bytes(MiB))
    paths[1].write_bytes(base)
    paths[2].write_bytes(head)
    return paths


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with the two-layer chain ``disk:v2`` (copied per test: some tests break it)."""
    tmp = tmp_path_factory.mktemp("nbd-chain")
    memory, base, head = _images(tmp)
    store = Store(tmp / "home")
    store.import_layer("disk:v1", memory=memory, disk=base)
    store.import_layer(REF, memory=memory, disk=head, parent="disk:v1")
    return tmp / "home"


@dataclass
class Chain:
    store: Store
    assembled: Path  # the head's disk, assembled eagerly
    run: Path


@pytest.fixture
def chain(template: Path, tmp_path: Path) -> Chain:
    shutil.copytree(template, tmp_path / "home")
    store = Store(tmp_path / "home")
    disk = store.assemble(REF).disk
    assert disk is not None
    return Chain(store, disk, tmp_path / "run")


def _nbd_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbd")]


@pytest.fixture(autouse=True)
def no_server_left() -> Iterator[None]:
    yield
    assert not _nbd_threads(), f"NBD server threads left: {_nbd_threads()}"


@pytest.fixture
def export(chain: Chain) -> Iterator[DiskExport]:
    ex = start_disk_export(open_local(chain.store, REF), chain.run)
    try:
        yield ex
    finally:
        ex.close()
    assert not ex.socket.exists()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=False)


def _qemu_io(target: str, *commands: str, fmt: str = "raw", readonly: bool = True
             ) -> subprocess.CompletedProcess[str]:
    argv = ["qemu-io", "-f", fmt] + (["-r"] if readonly else [])
    for c in commands:
        argv += ["-c", c]
    return _run(*argv, target)


# -- real QEMU clients -----------------------------------------------------------------
def test_export_equals_the_assembled_disk(chain: Chain, export: DiskExport) -> None:
    assert export.size == DISK_SIZE
    assert export.socket.stat().st_mode & 0o777 == 0o600  # only its owner may read the disk
    r = _run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(chain.assembled),
             export.backing_spec())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical" in r.stdout


def test_ranges_read_back(chain: Chain, export: DiskExport) -> None:
    r = _qemu_io(export.backing_spec(),
                 "read -P 0x02 4k 4k",  # the head's page over the base's chunk
                 "read -P 0 1M 4k",  # zeroed by the head
                 "read -P 0 3M 2M",  # a hole in every layer
                 "read -P 0x01 5M 8k",
                 "read -P 0 5128k 1M",  # right after them, unmapped
                 "read -P 0x03 11M 4k",
                 "read -P 0x01 5243000 880")  # unaligned
    assert r.returncode == 0 and "Pattern verification failed" not in r.stdout, r.stdout
    assert r.stdout.count("read ") == 7
    want = chain.assembled.read_bytes()
    for structured in (True, False):
        with _Client(export.socket, structured=structured) as c:
            for offset, length in [(5 * MiB - 880, 1000), (3 * MiB - 5, 10), (1, 4096 * 3),
                                   (9 * MiB + 4000, 9000), (DISK_SIZE - 7, 7)]:
                assert c.read(offset, length) == (0, want[offset : offset + length])


def test_holes_are_answered_without_a_fetch(chain: Chain) -> None:
    touched: list[str] = []
    with start_disk_export(open_local(chain.store, REF), chain.run,
                           on_access=touched.append) as ex:
        r = _qemu_io(ex.backing_spec(), "read -P 0 3M 2M", "read -P 0 6M 3M")
        assert r.returncode == 0, r.stdout + r.stderr
        assert touched == []
        r = _qemu_io(ex.backing_spec(), "read -P 0x03 11M 4k")
        assert r.returncode == 0 and len(touched) == 1


def test_two_clients_at_once(chain: Chain, export: DiskExport) -> None:
    argv = ["qemu-img", "compare", "-f", "raw", "-F", "raw", str(chain.assembled),
            export.backing_spec()]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # and two raw clients, each served while the other stays connected
    with _Client(export.socket) as a, _Client(export.socket) as b:
        want = chain.assembled.read_bytes()
        assert a.read(0, 65536) == (0, want[:65536])
        assert b.read(11 * MiB, 4096) == (0, want[11 * MiB : 11 * MiB + 4096])
        assert a.read(5 * MiB - 100, 300) == (0, want[5 * MiB - 100 : 5 * MiB + 200])
        assert export.server.connections == 2


def test_pipelined_reads_are_all_answered(chain: Chain, export: DiskExport) -> None:
    want = chain.assembled.read_bytes()
    ranges = [(i * MiB + 3, 70000) for i in range(11)] + [(3 * MiB, 2 * MiB)]
    with _Client(export.socket) as c:
        handles = {c.send_read(offset, length): (offset, length) for offset, length in ranges}
        got = c.replies(handles)  # more than a connection's read slots, in any order
        assert got == {h: (0, want[o : o + n]) for h, (o, n) in handles.items()}
        assert c.read(0, 4096) == (0, want[:4096])


def test_a_slow_chunk_does_not_hold_up_the_next_read(chain: Chain) -> None:
    source = open_local(chain.store, REF)
    slow = ImageLayout(source, "disk").chunks_at(5 * MiB, 4096)[0]
    gate = threading.Event()

    def on_access(digest: str) -> None:
        if digest == slow:  # as if this chunk were still on its way from the hub
            assert gate.wait(60)

    with start_disk_export(source, chain.run, on_access=on_access) as ex, \
            _Client(ex.socket) as c:
        a = c.send_read(5 * MiB, 4096)
        b = c.send_read(11 * MiB, 4096)
        assert c.replies({b: (11 * MiB, 4096)}) == {b: (0, b"\x03" * 4096)}
        gate.set()
        assert c.replies({a: (5 * MiB, 4096)}) == {a: (0, b"\x01" * 4096)}


def test_clients_that_stop_reading_block_only_themselves(chain: Chain,
                                                        export: DiskExport) -> None:
    stuck = [_Client(export.socket) for _ in range(3)]
    try:
        for c in stuck:  # replies far larger than the socket's buffer, never read
            for _ in range(nbd.MAX_READS_PER_CONNECTION + 1):
                c.send_read(0, nbd.MAX_BLOCK_BYTES)
        with _Client(export.socket) as c:
            assert c.read(11 * MiB, 4096) == (0, b"\x03" * 4096)
    finally:
        for c in stuck:
            c.close()


def test_overlay_takes_the_writes(chain: Chain, export: DiskExport, tmp_path: Path) -> None:
    overlay = tmp_path / "child.qcow2"
    export.create_overlay(overlay)
    info = _run("qemu-img", "info", str(overlay))
    assert export.backing_spec() in info.stdout and "backing file format: raw" in info.stdout
    w = _qemu_io(str(overlay), "write -P 0x77 0 64k", "write -P 0x66 3M 4k",
                 "read -P 0x77 0 64k", "read -P 0x03 11M 4k", fmt="qcow2", readonly=False)
    assert w.returncode == 0 and "failed" not in w.stdout, w.stdout + w.stderr
    # the export is unchanged; the overlay differs from it exactly where it was written
    same = _run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(chain.assembled),
                export.backing_spec())
    assert same.returncode == 0, same.stdout
    diff = _run("qemu-img", "compare", "-F", "raw", str(overlay), str(chain.assembled))
    assert diff.returncode == 1 and "offset 0" in diff.stdout, diff.stdout
    assert _qemu_io(export.backing_spec(), "read -P 0 3M 4k").returncode == 0


def test_writes_to_the_export_are_refused(export: DiskExport) -> None:
    r = _qemu_io(export.backing_spec(), "write -P 0x55 0 4k", readonly=False)
    assert "wrote" not in r.stdout, r.stdout
    with _Client(export.socket) as c:
        assert c.command(nbd.CMD_WRITE, 0, 4096, payload=b"\x55" * 4096) == nbd.EPERM
        assert c.command(nbd.CMD_TRIM, 0, 4096) == nbd.EPERM
        assert c.command(nbd.CMD_FLUSH, 0, 0) == 0
        assert c.read(4096, 4096) == (0, b"\x02" * 4096)  # the payload was drained


def test_unreadable_chunk_fails_that_read_only(chain: Chain) -> None:
    source = open_local(chain.store, REF)
    lost = ImageLayout(source, "disk").chunks_at(5 * MiB, 8192)
    assert len(lost) == 1
    assert isinstance(chain.store.blobs, FsBlobStore)
    chain.store.blobs.delete(lost[0])  # not local, and no hub to fetch it from
    with start_disk_export(source, chain.run) as ex:
        io = subprocess.Popen(["qemu-io", "-r", "-f", "raw", "-c", "read -P 0x01 5M 8k",
                               "-c", "read -P 0x03 11M 4k", ex.backing_spec()],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True)
        out = io.communicate(timeout=120)[0]
        assert "Input/output error" in out, out
        assert "read 4096/4096 bytes at offset 11534336" in out  # the next read works
        assert any(lost[0] in e for e in ex.errors), ex.errors
        assert [(f.pid, f.digest) for f in ex.failures] == [(io.pid, lost[0])]  # which child
        with _Client(ex.socket) as c:
            assert c.read(5 * MiB, 4096)[0] == nbd.EIO
            assert c.read(11 * MiB, 4096) == (0, b"\x03" * 4096)
        with _Client(ex.socket, structured=False) as c:
            assert c.read(5 * MiB, 4096) == (nbd.EIO, b"")
            assert c.read(0, 4096)[0] == 0


def test_blocks_come_from_the_hub_on_first_access(chain: Chain, tmp_path: Path) -> None:
    hub = HubServer(tmp_path / "hub").start()
    try:
        who = hub.add_user("nbd")
        remote = parse_remote(f"{hub.address}/nbd/{REF}")
        with RegistryClient(hub.target, Credential(*who)) as client:
            push(chain.store, REF, remote, client)
        fresh = Store(tmp_path / "fresh")
        with RegistryClient(hub.target, Credential(*who), timeout=5) as client:
            source = open_remote(fresh, remote, client)
            layout = ImageLayout(source, "disk")
            with start_disk_export(source, tmp_path / "run") as ex:
                r = _qemu_io(ex.backing_spec(), "read -P 0x02 4k 4k", "read -P 0 3M 2M")
                assert r.returncode == 0 and "failed" not in r.stdout, r.stdout + r.stderr
                first = layout.chunks_at(4096, 4096)
                source.flush()
                assert source.fetched_chunks == 1 and all(fresh.blobs.has(d) for d in first)
                later = layout.chunks_at(5 * MiB, 4096)[0]  # a chunk of the base layer
                assert not fresh.blobs.has(later)
                hub.stop()  # mid-run: what is not local yet cannot come any more
                with _Client(ex.socket) as c:
                    assert c.read(5 * MiB, 4096)[0] == nbd.EIO
                    assert c.read(4096, 4096) == (0, b"\x02" * 4096)  # fetched: still served
                    assert c.read(11 * MiB, 4096) == (0, b"\x03" * 4096)  # same diff chunk
                assert any(later in e and hub.address in e for e in ex.errors), ex.errors
        assert not fresh.blobs.has(later) and fresh.verify() == []
    finally:
        hub.stop()


def test_corrupt_chunk_is_never_served(chain: Chain) -> None:
    source = open_local(chain.store, REF)
    bad = ImageLayout(source, "disk").chunks_at(11 * MiB, 4096)[0]
    assert isinstance(chain.store.blobs, FsBlobStore)
    path = chain.store.blobs.path(bad)
    good = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    with start_disk_export(source, chain.run) as ex:
        for structured in (True, False):
            with _Client(ex.socket, structured=structured) as c:
                error, data = c.read(11 * MiB, 4096)
                assert error == nbd.EIO and b"\x03" not in data
        assert any(bad in e and "digest mismatch" in e for e in ex.errors), ex.errors


# -- malformed client input (a raw client: QEMU never sends these) ------------------------
def test_bad_client_flags_and_magic_end_the_connection(export: DiskExport) -> None:
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", 0x80))  # an unknown client flag
        assert c.closed()
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", 3) + struct.pack(">QII", 0x1234, nbd.OPT_GO, 0))
        assert c.closed()
    with _Client(export.socket) as c:
        c.sock.sendall(struct.pack(">IHHQQI", 0xDEADBEEF, 0, nbd.CMD_READ, 1, 0, 4096))
        assert c.closed()
    with _Client(export.socket) as c:  # the server goes on
        assert c.read(0, 512)[0] == 0


def test_huge_option_gets_an_error_not_an_allocation(export: DiskExport) -> None:
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", 3) + struct.pack(">QII", nbd.IHAVEOPT, nbd.OPT_GO,
                                                          0xFFFFFFFF))
        option, reply, _ = c.option_reply()
        assert (option, reply) == (nbd.OPT_GO, nbd.REP_ERR_TOO_BIG)
        assert c.closed()


def test_malformed_options_get_errors(export: DiskExport) -> None:
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", 3))
        c.option(nbd.OPT_GO, struct.pack(">I", 100) + b"disk" + struct.pack(">H", 0))
        assert c.option_reply()[1] == nbd.REP_ERR_INVALID  # name longer than the option
        c.option(nbd.OPT_GO, struct.pack(">I", 4) + b"disk" + struct.pack(">H", 5))
        assert c.option_reply()[1] == nbd.REP_ERR_INVALID  # 5 info requests, none sent
        c.option(nbd.OPT_GO, struct.pack(">I", 5) + b"other" + struct.pack(">H", 0))
        assert c.option_reply()[1] == nbd.REP_ERR_UNKNOWN
        c.option(0x4242, b"")
        assert c.option_reply()[1] == nbd.REP_ERR_UNSUP
        c.go()  # still negotiable
        c.structured = False  # never asked for
        assert c.read(4096, 4096) == (0, b"\x02" * 4096)
    with _Client(export.socket, handshake=False) as c:  # endless options are cut off
        c.greeting()
        c.sock.sendall(struct.pack(">I", 3))
        for _ in range(nbd.MAX_OPTIONS):
            c.option(0x4242, b"")
            assert c.option_reply()[1] == nbd.REP_ERR_UNSUP
        # The server may hang up right after the last allowed reply, before this option
        # is sent (a broken pipe) or once it arrives: either way the connection ends.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            c.option(0x4242, b"")
        assert c.closed()


def test_export_name_option_of_older_clients(chain: Chain, export: DiskExport) -> None:
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", nbd.FLAG_FIXED_NEWSTYLE))  # no NO_ZEROES
        c.option(nbd.OPT_EXPORT_NAME, b"disk")
        size, flags = struct.unpack(">QH", c.recv(10))
        assert size == DISK_SIZE and flags & nbd.FLAG_READ_ONLY
        assert c.recv(124) == bytes(124)
        c.structured = False
        want = chain.assembled.read_bytes()
        assert c.read(0, 4 * MiB) == (0, want[: 4 * MiB])  # no block sizes agreed: up to 32 MiB
    with _Client(export.socket, handshake=False) as c:
        c.greeting()
        c.sock.sendall(struct.pack(">I", 3))
        c.option(nbd.OPT_EXPORT_NAME, b"elsewhere")  # no way to answer an error: hang up
        assert c.closed()


def test_bad_requests_get_einval(export: DiskExport) -> None:
    for structured in (True, False):
        with _Client(export.socket, structured=structured) as c:
            assert c.read(DISK_SIZE - 4096, 8192)[0] == nbd.EINVAL  # past the end
            assert c.read(DISK_SIZE + 4096, 512)[0] == nbd.EINVAL
            assert c.read(2**64 - 512, 512)[0] == nbd.EINVAL
            assert c.read(0, 0)[0] == nbd.EINVAL
            assert c.read(0, nbd.MAX_BLOCK_BYTES + 1)[0] == nbd.EINVAL  # over the agreed block
            assert c.command(0x77, 0, 0) == nbd.EINVAL
            assert c.read(DISK_SIZE - 4096, 4096)[0] == 0  # the connection goes on
    with _Client(export.socket) as c:  # a write payload too large to drain ends it
        c.sock.sendall(struct.pack(">IHHQQI", nbd.REQUEST_MAGIC, 0, nbd.CMD_WRITE, 9, 0,
                                   nbd.MAX_REQUEST_BYTES + 1))
        assert c.closed()


def test_connections_and_handshakes_are_bounded(export: DiskExport,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nbd, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(nbd, "HANDSHAKE_TIMEOUT", 0.5)
    with _Client(export.socket) as a, _Client(export.socket, handshake=False) as idle:
        idle.greeting()  # then says nothing: cut off after the handshake timeout
        with _Client(export.socket, handshake=False) as extra:
            assert extra.closed()  # over the limit: closed at once, no greeting
        assert idle.closed()
        assert a.read(0, 512)[0] == 0  # a client past the handshake has no timeout
        with _Client(export.socket) as b:  # the idle one's place is free again
            assert b.read(11 * MiB, 4096) == (0, b"\x03" * 4096)


def test_close_leaves_nothing(chain: Chain) -> None:
    ex = start_disk_export(open_local(chain.store, REF), chain.run)
    clients = [_Client(ex.socket) for _ in range(3)]
    assert _nbd_threads()
    ex.close()
    ex.close()  # idempotent
    assert not ex.socket.exists() and not _nbd_threads()
    for c in clients:
        assert c.closed()
        c.close()
    with pytest.raises(OSError):
        _Client(ex.socket)


# -- a child VM on the export ----------------------------------------------------------------
@pytest.mark.vm
def test_child_boots_on_an_overlay_of_the_export(store: Store, tiny: str,
                                                 engine_env: dict[str, Path],
                                                 cleanup_children: None) -> None:
    from forkd.engine import children as ch
    from forkd.engine.lifecycle import Limits, new_id

    asm = store.assemble(tiny)
    assert asm.disk is not None
    run = engine_env["FORKD_RUN"] / "nbd-vm"
    touched: list[str] = []
    with start_disk_export(open_local(store, tiny), run, on_access=touched.append) as ex:
        overlay = run / "empty.qcow2"
        ex.create_overlay(overlay)
        w = ch.launch_waiting(asm, tiny, new_id(tiny), overlay, Limits().checked(),
                              sandbox=True, with_netns=False)
        info = ch.become_child(w)
        try:
            before = len(touched)
            r = ch.exec_in(info.id, ["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches && "
                                     "cat /etc/forkd-recipe"])
            assert r["exit_code"] == 0 and r["stdout"] == "tiny\n", r
            assert len(touched) > before  # read from the export, not the guest's cache
            r = ch.exec_in(info.id, ["sh", "-c", "echo mine > /root/nbd-child && sync && "
                                     "echo 3 > /proc/sys/vm/drop_caches && cat /root/nbd-child"])
            assert r["exit_code"] == 0 and r["stdout"] == "mine\n", r
        finally:
            ch.kill(info.id)
        assert not ex.errors
        same = _run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(asm.disk),
                    ex.backing_spec())
        assert same.returncode == 0, same.stdout  # the child's write stayed in its overlay


@pytest.mark.vm
def test_a_child_whose_export_is_gone_fails_saying_why(store: Store, tiny: str,
                                                       engine_env: dict[str, Path],
                                                       cleanup_children: None) -> None:
    """QEMU exits at start when its disk's export is gone: the error names the child, how
    QEMU ended and its log's reason (it was a bare "[Errno 104] Connection reset by peer"
    from the QMP greeting), and nothing of the child is left."""
    from forkd.engine import children as ch
    from forkd.engine.errors import VMMError
    from forkd.engine.lifecycle import Limits, new_id
    from forkd.engine.paths import children_dir

    asm = store.assemble(tiny)
    run = engine_env["FORKD_RUN"] / "nbd-gone"
    with start_disk_export(open_local(store, tiny), run) as ex:
        overlay = run / "empty.qcow2"
        ex.create_overlay(overlay)
    child_id = new_id(tiny)
    with pytest.raises(VMMError) as failed:
        ch.launch_waiting(asm, tiny, child_id, overlay, Limits().checked(), sandbox=True,
                          with_netns=False)
    message = str(failed.value)
    assert f"child {child_id}" in message
    assert "QEMU ended: exit status 1" in message
    assert "disk.nbd.sock" in message and "Failed to connect" in message, message
    assert message.count("--- qemu.log") == 1, message  # the log once, not once per layer
    assert not (children_dir() / child_id).exists()


# -- a minimal NBD client -------------------------------------------------------------------
class _Client:
    """Speaks the protocol over the export's socket (handshake, then requests in order)."""

    def __init__(self, path: Path, *, structured: bool = True, handshake: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.handle = 0
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self.structured = structured
        if handshake:
            self.greeting()
            self.sock.sendall(struct.pack(">I", nbd.FLAG_FIXED_NEWSTYLE | nbd.FLAG_NO_ZEROES))
            if structured:
                self.option(nbd.OPT_STRUCTURED_REPLY, b"")
                assert self.option_reply()[1] == nbd.REP_ACK
            self.go()

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            part = self.sock.recv(n - len(out))
            if not part:
                raise EOFError("the server closed the connection")
            out += part
        return out

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def greeting(self) -> None:
        magic, opt, flags = struct.unpack(">QQH", self.recv(18))
        assert (magic, opt) == (nbd.NBDMAGIC, nbd.IHAVEOPT) and flags & nbd.FLAG_FIXED_NEWSTYLE

    def option(self, option: int, data: bytes) -> None:
        self.sock.sendall(struct.pack(">QII", nbd.IHAVEOPT, option, len(data)) + data)

    def option_reply(self) -> tuple[int, int, bytes]:
        magic, option, reply, length = struct.unpack(">QIII", self.recv(20))
        assert magic == nbd.OPTION_REPLY_MAGIC
        return option, reply, self.recv(length)

    def go(self) -> None:
        self.option(nbd.OPT_GO, struct.pack(">I", 4) + b"disk" +
                    struct.pack(">HH", 1, nbd.INFO_BLOCK_SIZE))
        while True:
            _, reply, data = self.option_reply()
            if reply == nbd.REP_ACK:
                return
            assert reply == nbd.REP_INFO, reply
            if struct.unpack_from(">H", data)[0] == nbd.INFO_EXPORT:
                size, flags = struct.unpack_from(">QH", data, 2)
                assert size == DISK_SIZE and flags & nbd.FLAG_READ_ONLY

    def _request(self, command: int, offset: int, length: int, payload: bytes = b"") -> int:
        self.handle += 1
        self.sock.sendall(struct.pack(">IHHQQI", nbd.REQUEST_MAGIC, 0, command, self.handle,
                                      offset, length) + payload)
        return self.handle

    def command(self, command: int, offset: int, length: int, payload: bytes = b"") -> int:
        """A command without reply data: its error (0 = success)."""
        handle = self._request(command, offset, length, payload)
        magic = struct.unpack(">I", self.recv(4))[0]
        if magic == nbd.SIMPLE_REPLY_MAGIC:
            error, got = struct.unpack(">IQ", self.recv(12))
            assert got == handle
            return int(error)
        assert magic == nbd.STRUCTURED_REPLY_MAGIC
        flags, kind, got, length = struct.unpack(">HHQI", self.recv(16))
        payload = self.recv(length)
        assert got == handle and flags & nbd.REPLY_FLAG_DONE
        return int(struct.unpack_from(">I", payload)[0]) if kind & (1 << 15) else 0

    def read(self, offset: int, length: int) -> tuple[int, bytes]:
        """(error, the bytes read): what one READ answers, simple or structured."""
        handle = self.send_read(offset, length)
        if not self.structured:
            magic, error, got = struct.unpack(">IIQ", self.recv(16))
            assert magic == nbd.SIMPLE_REPLY_MAGIC and got == handle
            return error, b"" if error else self.recv(length)
        return self.replies({handle: (offset, length)})[handle]

    def send_read(self, offset: int, length: int) -> int:
        return self._request(nbd.CMD_READ, offset, length)

    def replies(self, reads: dict[int, tuple[int, int]]) -> dict[int, tuple[int, bytes]]:
        """The structured replies to ``reads`` (handle → offset, length), in any order:
        handle → (error, bytes; on an error zeros but for any data chunks sent)."""
        out = {h: bytearray(n) for h, (_, n) in reads.items()}
        errors = dict.fromkeys(reads, 0)
        done: set[int] = set()
        while len(done) < len(reads):
            magic, flags, kind, handle, size = struct.unpack(">IHHQI", self.recv(20))
            assert magic == nbd.STRUCTURED_REPLY_MAGIC and handle in reads and handle not in done
            offset, length = reads[handle]
            payload = self.recv(size)
            if kind == nbd.REPLY_TYPE_OFFSET_DATA:
                at = struct.unpack_from(">Q", payload)[0] - offset
                assert at >= 0 and at + size - 8 <= length
                out[handle][at : at + size - 8] = payload[8:]
            elif kind == nbd.REPLY_TYPE_OFFSET_HOLE:
                at, n = struct.unpack_from(">QI", payload)
                assert offset <= at and at + n <= offset + length
            elif kind & (1 << 15):
                errors[handle] = struct.unpack_from(">I", payload)[0]
            if flags & nbd.REPLY_FLAG_DONE:
                done.add(handle)
        return {h: (errors[h], bytes(out[h])) for h in reads}



# -- one socket per export, one server per store --------------------------------------------
def test_an_export_removes_only_its_own_socket(chain: Chain) -> None:
    """A later export on the same path (an exiting server's successor) keeps its socket
    when the earlier one closes."""
    first = start_disk_export(open_local(chain.store, REF), chain.run)
    second = start_disk_export(open_local(chain.store, REF), chain.run)
    first.close()
    try:
        assert second.socket.exists()
        r = _run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(chain.assembled),
                 second.backing_spec())
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        second.close()
    assert not second.socket.exists()


def test_two_stores_serving_one_snapshot_have_a_socket_each(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores on one host, each with its own lazy server of the same snapshot: the
    disk sockets differ, and one server's exit leaves the other's export serving (they
    shared one path, and an exiting server removed the socket of the other: its next
    children failed to open their disk)."""
    from forkd.engine.lazy import fork as lazy
    from forkd.engine.qemu import pid_alive

    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    stores = []
    for name in ("a", "b"):
        shutil.copytree(template, tmp_path / name)
        stores.append(Store(tmp_path / name))
    with contextlib.ExitStack() as held:
        snaps = [held.enter_context(lazy.holding(s, open_local(s, REF), None, None,
                                                 prefetch=False)) for s in stores]
        a, b = snaps
        assert a.disk is not None and b.disk is not None and a.disk != b.disk
        b_held = os.open(b.memory, os.O_RDONLY)  # b serves on past this block
    try:
        deadline = time.monotonic() + 30
        while pid_alive(a.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(a.pid), "server a did not exit once its file was closed"
        assert b.disk.exists(), "server a's exit removed server b's disk socket"
        r = _run("qemu-img", "compare", "-f", "raw", "-F", "raw",
                 str(stores[1].assemble(REF).disk), f"nbd+unix:///disk?socket={b.disk}")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        os.close(b_held)
        deadline = time.monotonic() + 30
        while pid_alive(b.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not pid_alive(b.pid) and not b.disk.exists()


def test_a_serving_mount_has_its_read_ahead_off(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lazy server's memory mount reads what a child touches and no more
    (memfs.no_read_ahead): around a page missing from the page cache the kernel asked for
    128 KiB, and where the working set was pushed already the rest of that window is
    memory no child touched, whose chunks a new host fetched from the hub before the
    touched page was answered. Before, only a recording's mount had it off."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount needs root and /dev/fuse")
    from forkd.engine.lazy import fork as lazy
    from forkd.engine.lazy import memfs
    from forkd.engine.qemu import pid_alive

    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    shutil.copytree(template, tmp_path / "home")
    store = Store(tmp_path / "home")
    with lazy.holding(store, open_local(store, REF), None, None, prefetch=False) as snap:
        setting = memfs.read_ahead_setting(str(snap.memory.parent))
        assert setting.read_text().strip() == "0"
        with snap.memory.open("rb") as f:  # and it serves
            assert f.read(4096) == store.assemble(REF).memory.read_bytes()[:4096]
    deadline = time.monotonic() + 30
    while pid_alive(snap.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(snap.pid), "the server did not exit once its file was closed"
