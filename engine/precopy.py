"""Live copy of a running child's memory for `forkd branch`: QEMU's own precopy migration.

QEMU streams the guest RAM into a pipe while the guest runs, tracks the pages the guest writes
meanwhile (its dirty log, under TCG and KVM alike) and sends them again, round after round,
until what is left fits the downtime limit; then it stops the guest, sends the rest and the
device state, and stays paused ("postmigrate") until the caller resumes it with `cont`.
So the pause holds only the pages written in the last round, whatever the dirty size.

This reader keeps, per guest page, only the latest copy that differs from the parent image
(the file the child maps copy-on-write): the result is exactly the pages that differ from the
parent at the pause. Pages the guest never wrote equal the parent and are dropped on arrival.

Why not the kernel's soft-dirty bits (clear_refs 4 + pagemap bit 55): they need
CONFIG_MEM_SOFT_DIRTY, which this host's kernel lacks (the bit never sets), and reading them
then clearing them is not atomic without pausing the guest. QEMU's dirty log has neither
problem.

Stream format read here (QEMU 7.2 savevm.c / ram.c, no configuration section: children run with
``migration.send-configuration=off``): magic "QEVM", version 3; iterative sections of the
"ram" handler (START / PART / END, each a list of page records closed by EOS, then a footer);
then the device sections (FULL), EOF and QEMU's JSON description (VMDESCRIPTION, its length
first). The header, the device sections and EOF are the branch's device state: byte for byte
what `xen-save-devices-state` writes from the same paused guest (compared here: identical), so
the pause does not save it a second time.

The pause holds only what must see the guest stopped: the stream's last round and device
sections, and a re-read of the pages the guest wrote during the copy (into the diff, raw).
Comparing those pages with the parent and unmapping the parent image (~80 ms for a 512 MiB
guest whose every page was compared) wait until the guest runs again (`LiveCopy.settle`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import io
import json
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.engine.errors import HostError, VMMError
from forkd.engine.qmp import QMP

PAGE = 4096
# engine/qemu.py maps the guest RAM as `-object memory-backend-file,id=mem`: the RAM block "mem"
RAM_BLOCK = b"mem"

_MAGIC, _VERSION = 0x5145564D, 3
_EOF, _START, _PART, _END, _FULL, _FOOTER = 0x00, 0x01, 0x02, 0x03, 0x04, 0x7E
_ZERO, _MEM_SIZE, _PAGE_FLAG, _EOS, _CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
_FLAG_BITS = PAGE - 1
_ZERO_PAGE = bytes(PAGE)
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
_IOV_MAX = 1024
_VMDESCRIPTION = 0x06
_MAX_DEVICE_STATE = 64 << 20  # bytes after the RAM sections (device state + description)
_FD_NAME = "forkd-branch"
# forced completion: the rest fits this "downtime", so QEMU stops the guest and finishes
_FORCE_DOWNTIME_MS = 2_000_000  # QEMU's maximum (2000 s)
# per-page state in Diff.state; _HELD: read raw while paused, compared with the parent later
_SAME, _DATA, _ZEROED, _HELD = 0, 1, 2, 3


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def ram_mapping(pid: int, mem_path: Path) -> tuple[int, int, int]:
    """(start, end, file offset) of the guest-RAM mapping of mem_path in the process."""
    real = str(mem_path.resolve())
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                return a, b, int(parts[2], 16)
    raise HostError(f"process {pid} has no mapping of {real}; is it a forkd child?")


def _runs(idx: list[int]) -> Iterator[tuple[int, int]]:
    if not idx:
        return
    first = prev = idx[0]
    for i in idx[1:]:
        if i != prev + 1:
            yield first, prev - first + 1
            first = i
        prev = i
    yield first, prev - first + 1


def _readv(pid: int, runs: list[tuple[int, int, int]]) -> None:
    """process_vm_readv of (local address, remote address, length) runs, IOV_MAX at a time."""
    for k in range(0, len(runs), _IOV_MAX):
        part = runs[k:k + _IOV_MAX]
        local = (_IoVec * len(part))()
        remote = (_IoVec * len(part))()
        total = 0
        for j, (here, there, n) in enumerate(part):
            local[j].iov_base, local[j].iov_len = here, n
            remote[j].iov_base, remote[j].iov_len = there, n
            total += n
        got = _libc.process_vm_readv(pid, local, len(part), remote, len(part), 0)
        if got != total:
            err = ctypes.get_errno()
            raise HostError(f"process_vm_readv read {got} of {total} bytes: {os.strerror(err)} "
                            "(needs root or CAP_SYS_PTRACE)")


def read_pages(pid: int, start: int, idx: list[int], buf: ctypes.Array[ctypes.c_char]) -> None:
    """process_vm_readv the pages into buf, packed in idx order."""
    base = ctypes.addressof(buf)
    runs = []
    off = 0
    for i, c in _runs(idx):
        runs.append((base + off, start + i * PAGE, c * PAGE))
        off += c * PAGE
    _readv(pid, runs)


def read_pages_in_place(pid: int, start: int, idx: list[int], base: int) -> None:
    """process_vm_readv page i of the mapping at start to base + i * PAGE, for i in idx."""
    _readv(pid, [(base + i * PAGE, start + i * PAGE, c * PAGE) for i, c in _runs(idx)])


@dataclass(frozen=True)
class PrecopySettings:
    """Limits of one live copy (defaults documented in docs/engine.md, Branch)."""

    downtime_limit_ms: int = 5  # QEMU stops the guest once the rest fits in this at its rate
    max_rounds: int = 12  # dirty-log rounds, then QEMU is told to finish (a hot writer)
    timeout_s: float = 300.0  # whole copy; then it is cancelled and the child resumed
    max_bandwidth: int = 1 << 36  # bytes/s: no throttling (QEMU's default is 32 MiB/s)


class ParentImage:
    """The parent's memory image (read-only): which pages hold data, and their bytes."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            have = os.fstat(self._fd).st_size
            if have != size:
                raise VMMError(f"the parent memory image {path} has {have} bytes, the guest "
                               f"RAM {size}; the child does not map this image")
            self.data = self._data_pages(size)
            self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(self._fd)
            raise

    def _data_pages(self, size: int) -> bytearray:
        """1 for pages in a data extent (holes read as zeros and are never faulted in)."""
        mask = bytearray(size // PAGE)
        off = 0
        while off < size:
            try:
                start = os.lseek(self._fd, off, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after off
                break
            end = os.lseek(self._fd, start, os.SEEK_HOLE)
            first, last = start // PAGE, (min(end, size) + PAGE - 1) // PAGE
            mask[first:last] = b"\x01" * (last - first)
            off = end
        return mask

    def differs(self, index: int, page: bytes | bytearray) -> bool:
        if not self.data[index]:
            return page != _ZERO_PAGE
        return page != self._map[index * PAGE:(index + 1) * PAGE]

    def is_zero(self, index: int) -> bool:
        return not self.data[index] or self._map[index * PAGE:(index + 1) * PAGE] == _ZERO_PAGE

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


class Diff:
    """The guest pages that differ from the parent, latest copy of each (sparse buffer)."""

    def __init__(self, size: int) -> None:
        self.pages = size // PAGE
        self.state = bytearray(self.pages)
        self.sends = bytearray(self.pages)  # times each page arrived, saturating at 2
        self._buf = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._cview: ctypes.Array[ctypes.c_char] | None = (
            ctypes.c_char * size).from_buffer(self._buf)
        self.address = ctypes.addressof(self._cview)  # page i is at address + i * PAGE
        self.records = 0  # page records read (all rounds)
        self._held: list[int] = []
        self.settled = False  # every page compared with the parent (Diff.settle)

    def _arrived(self, index: int) -> None:
        self.records += 1
        if self.sends[index] < 2:
            self.sends[index] += 1

    def put(self, index: int, page: bytes | bytearray, parent: ParentImage) -> None:
        self._arrived(index)
        if parent.differs(index, page):
            self._buf[index * PAGE:(index + 1) * PAGE] = page
            self.state[index] = _DATA
        else:
            self.state[index] = _SAME

    def put_zero(self, index: int, parent: ParentImage) -> None:
        self._arrived(index)
        self.state[index] = _SAME if parent.is_zero(index) else _ZEROED

    def hold(self, idx: list[int]) -> None:
        """These pages were written into the buffer in place (read from the paused guest);
        `settle` compares them with the parent."""
        for i in idx:
            self.state[i] = _HELD
        self._held.extend(idx)

    def settle(self, parent: ParentImage) -> None:
        """Keep the held pages that differ from the parent, drop the others."""
        for i in self._held:
            if self.state[i] == _HELD:
                differs = parent.differs(i, self._buf[i * PAGE:(i + 1) * PAGE])
                self.state[i] = _DATA if differs else _SAME
        self._held = []
        self.settled = True

    def _settled(self) -> None:
        if not self.settled:
            raise VMMError("the diff is read before its live copy was settled (LiveCopy.settle "
                           "checks the copy completed and compares the re-read pages)")

    def missing(self) -> int:
        return self.sends.count(0)

    def rewritten(self) -> list[int]:
        """Pages sent more than once: the guest wrote them while the copy ran. (In the pause:
        bytearray.find is memchr, ~50x faster than a regex over the 131072 bytes of 512 MiB.)"""
        idx = []
        i = self.sends.find(2)
        while i >= 0:
            idx.append(i)
            i = self.sends.find(2, i + 1)
        return idx

    def count(self) -> int:
        self._settled()
        return self.pages - self.state.count(_SAME)

    def items(self) -> Iterator[tuple[int, bytes]]:
        """(page index, 4096 bytes) in increasing order."""
        self._settled()
        for m in re.finditer(rb"[\x01\x02]+", self.state):
            for i in range(m.start(), m.end()):
                if self.state[i] == _ZEROED:
                    yield i, _ZERO_PAGE
                else:
                    yield i, self._buf[i * PAGE:(i + 1) * PAGE]

    def close(self) -> None:
        self._cview = None  # the buffer's export, or mmap refuses to close
        self._buf.close()


class _Stream:
    """Reads one outgoing migration stream: RAM records into a Diff, the rest as device state."""

    def __init__(self, f: io.BufferedReader[io.FileIO], diff: Diff, parent: ParentImage,
                 ram_size: int, ignore_shared: bool) -> None:
        self.f, self.diff, self.parent = f, diff, parent
        self.ram_size, self.ignore_shared = ram_size, ignore_shared
        self.block: bytes | None = None
        self.blocks: dict[bytes, int] = {}
        self.ram_section: int | None = None
        self.scratch = bytearray(PAGE)
        self.end_records = 0  # RAM records of the END section: sent with the guest paused
        self.paused = threading.Event()  # QEMU stopped the guest: the END section began
        self.header = b""
        self.tail = b""  # after the RAM sections: device sections, EOF, QEMU's description

    def exact(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise VMMError("the migration stream ended early; see the child's qemu.log")
        return b

    def u8(self) -> int:
        return self.exact(1)[0]

    def be32(self) -> int:
        return int(struct.unpack(">I", self.exact(4))[0])

    def be64(self) -> int:
        return int(struct.unpack(">Q", self.exact(8))[0])

    def idstr(self) -> bytes:
        return self.exact(self.u8())

    def run(self) -> None:
        header = self.exact(8)
        magic, version = struct.unpack(">II", header)
        if (magic, version) != (_MAGIC, _VERSION):
            raise VMMError(f"unexpected migration stream header {header.hex()}")
        self.header = header
        while True:
            kind = self.u8()
            if kind == _START:
                section = self.be32()
                name = self.idstr()
                self.exact(8)  # instance id, version id
                if name != b"ram":
                    raise VMMError(f"unexpected iterative migration section {name!r}; only "
                                   "RAM is expected (is a block migration capability on?)")
                self.ram_section = section
                self.ram_records()
                self.footer(section)
            elif kind in (_PART, _END):
                section = self.be32()
                if section != self.ram_section:
                    raise VMMError(f"migration section {section} is not the RAM section")
                before = self.diff.records
                if kind == _END:
                    self.paused.set()
                self.ram_records()
                if kind == _END:
                    self.end_records += self.diff.records - before
                self.footer(section)
            elif kind in (_FULL, _EOF):
                self.tail = bytes([kind]) + self.rest()
                return
            else:
                raise VMMError(f"unexpected migration section type {kind:#x}")

    def rest(self) -> bytes:
        """The stream to its end (QEMU closes it when the migration completes), bounded."""
        parts = []
        size = 0
        while chunk := self.f.read(_PIPE_BYTES):
            size += len(chunk)
            if size > _MAX_DEVICE_STATE:
                raise VMMError(f"the migration stream carries over {_MAX_DEVICE_STATE >> 20} "
                               "MiB after the guest RAM; a forkd child's device state is far "
                               "smaller (is another RAM block or device migrating?)")
            parts.append(chunk)
        return b"".join(parts)

    def footer(self, section: int) -> None:
        peek = getattr(self.f, "peek", None)
        if peek is not None and peek(1)[:1] == bytes([_FOOTER]):
            self.exact(1)
            if self.be32() != section:
                raise VMMError("migration section footer does not match its section")

    def ram_records(self) -> None:
        while True:
            word = self.be64()
            flags, addr = word & _FLAG_BITS, word & ~_FLAG_BITS
            kind = flags & ~_CONTINUE
            if kind == _EOS:
                return
            if kind == _MEM_SIZE:
                self.mem_sizes(addr)
                continue
            if kind not in (_ZERO, _PAGE_FLAG):
                raise VMMError(f"unsupported RAM record flags {flags:#x} (compression, XBZRLE "
                               "or RDMA must stay off for a live branch)")
            if not flags & _CONTINUE:
                self.block = self.idstr()
            ours = self.block == RAM_BLOCK
            index = addr // PAGE
            if ours and addr >= self.ram_size:
                raise VMMError(f"RAM record at {addr:#x} is past the guest RAM")
            if kind == _ZERO:
                fill = self.u8()
                if ours and fill == 0:
                    self.diff.put_zero(index, self.parent)
                elif ours:
                    self.diff.put(index, bytearray([fill]) * PAGE, self.parent)
            elif ours:
                if self.f.readinto(self.scratch) != PAGE:
                    raise VMMError("the migration stream ended inside a page")
                self.diff.put(index, self.scratch, self.parent)
            else:
                self.exact(PAGE)

    def mem_sizes(self, total: int) -> None:
        while total > 0:
            name = self.idstr()
            used = self.be64()
            if self.ignore_shared:
                self.be64()  # the block's guest address
            self.blocks[name] = used
            total -= used
        if self.blocks.get(RAM_BLOCK) != self.ram_size:
            raise VMMError(f"the migration stream's RAM blocks {self.blocks} do not hold the "
                           f"guest RAM {RAM_BLOCK.decode()!r} of {self.ram_size} bytes")


def device_state(header: bytes, tail: bytes) -> bytes:
    """The stream's device state as a vmstate file: its header, the device sections and EOF;
    QEMU's JSON description after them (VMDESCRIPTION, be32 length, JSON) is cut off."""
    end = len(tail)
    while (i := tail.rfind(bytes([_VMDESCRIPTION]), 0, end)) >= 0:
        json_bytes = len(tail) - i - 5
        if json_bytes >= 0 and int(struct.unpack(">I", tail[i + 1:i + 5])[0]) == json_bytes:
            break
        end = i
    if i < 1 or tail[i - 1] != _EOF:
        raise VMMError("the migration stream does not end with EOF and QEMU's device description; "
                       "the device state cannot be cut out of it (is suppress-vmdesc on?)")
    try:
        desc = json.loads(tail[i + 5:])
    except ValueError as e:
        raise VMMError(f"the migration stream's device description is not JSON: {e}") from e
    if not isinstance(desc, dict) or not isinstance(desc.get("devices"), list):
        raise VMMError("the migration stream's device description lists no devices")
    return header + tail[:i]


class LiveCopy:
    """A live copy whose stream was read to its end, returned with the guest paused. Once the
    guest runs again, `settle` checks that QEMU completed the migration and finishes the diff
    (compares the pages re-read in the pause) and the device state; `close` frees the buffers."""

    def __init__(self, diff: Diff, parent: ParentImage, stream: _Stream, *, forced: bool,
                 reread: int, copy_ms: float) -> None:
        self.diff = diff
        self._parent: ParentImage | None = parent
        self._stream = stream
        self.forced = forced  # the guest kept writing: QEMU told to finish after max_rounds
        self.copy_ms = copy_ms  # migrate command → guest paused with everything read
        self.pause_records = stream.end_records + reread  # pages copied with the guest paused
        self.rounds = 0  # QEMU's dirty-log syncs (1 = the first full pass only), after settle
        self.qemu_downtime_ms = -1.0  # QEMU's own figure: its stop → completion, after settle
        self.device_state = b""  # a vmstate file (header, device sections, EOF), after settle

    def settle(self, q: QMP) -> None:
        """With the guest running: check that the migration completed (a failed one ends the
        stream too, and QEMU resumes the guest itself), keep the re-read pages that differ from
        the parent, release the parent image, cut the device state out of the stream's tail."""
        parent = self._parent
        if parent is None:
            raise VMMError("this live copy was settled or closed already")
        st = _status(q)
        if st.get("status") != "completed":
            raise VMMError(f"the live copy ended as {st.get('status')!r}: "
                           f"{st.get('error-desc', 'see the child qemu.log')}")
        if self.diff.missing():
            raise VMMError(f"the migration stream left {self.diff.missing()} guest pages out")
        counters = st.get("ram")
        if isinstance(counters, dict):
            self.rounds = int(counters.get("dirty-sync-count", 0))
        downtime = st.get("downtime")
        if isinstance(downtime, int):
            self.qemu_downtime_ms = float(downtime)
        self.device_state = device_state(self._stream.header, self._stream.tail)
        self.diff.settle(parent)
        self._release_parent()

    def _release_parent(self) -> None:
        if self._parent is not None:
            self._parent.close()
            self._parent = None

    def close(self) -> None:
        self._release_parent()
        self.diff.close()


def _status(q: QMP) -> dict[str, object]:
    return dict(q.command("query-migrate"))


def _ignore_shared(q: QMP) -> bool:
    for cap in q.command("query-migrate-capabilities"):
        if cap.get("capability") == "x-ignore-shared":
            return bool(cap.get("state"))
    return False


def _guest_ram(pid: int, parent_image: Path, ram_size: int) -> int:
    """Address of the guest RAM in the QEMU process (the whole image mapped from offset 0)."""
    start, end, offset = ram_mapping(pid, parent_image)
    if offset != 0 or end - start != ram_size:
        raise HostError(f"process {pid} maps {end - start} bytes of {parent_image} at offset "
                        f"{offset}, not the guest RAM of {ram_size} bytes from 0")
    return start


def live_copy(q: QMP, pid: int, parent_image: Path, ram_size: int,
              settings: PrecopySettings = PrecopySettings()) -> LiveCopy:
    """Copy the running guest's RAM; return with the guest paused (postmigrate) and all of it
    read. The caller resumes it (`cont`) after whatever else the pause must hold, then calls
    `settle`, which raises if the copy did not complete. On any error before the return the
    migration is cancelled, the guest resumed if it was paused, and VMMError raised."""
    ignore_shared = _ignore_shared(q)
    ram = _guest_ram(pid, parent_image, ram_size)
    q.command("migrate-set-parameters", {"max-bandwidth": settings.max_bandwidth,
                                         "downtime-limit": settings.downtime_limit_ms})
    parent = ParentImage(parent_image, ram_size)
    try:
        diff = Diff(ram_size)
    except BaseException:
        parent.close()
        raise
    failure: list[BaseException] = []
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_BYTES)
    reader = io.BufferedReader(io.FileIO(r, "rb"), buffer_size=_PIPE_BYTES)
    stream = _Stream(reader, diff, parent, ram_size, ignore_shared)

    def read() -> None:
        try:
            stream.run()
        except BaseException as e:  # reported by the waiting thread
            failure.append(e)
            with contextlib.suppress(OSError):
                reader.close()  # QEMU's writes fail: the migration fails instead of hanging

    thread = threading.Thread(target=read, name="forkd-branch-stream", daemon=True)
    thread.start()
    t0 = time.monotonic()
    started = False
    try:
        try:
            q.command("getfd", {"fdname": _FD_NAME}, fds=[w])
        finally:
            os.close(w)
        q.command("migrate", {"uri": f"fd:{_FD_NAME}"})
        started = True
        forced = _wait(q, thread, settings, t0, stream)
        if failure:
            raise failure[0]
        # The stream ended: QEMU completed (guest paused) or failed (guest resumed by QEMU);
        # settle tells which, after the caller's resume, so no QMP round trip is in the pause.
        reread = _hold_rewritten(pid, ram, diff)
        return LiveCopy(diff, parent, stream, forced=forced, reread=reread,
                        copy_ms=(time.monotonic() - t0) * 1000)
    except BaseException:
        _abandon(q, started)
        thread.join(timeout=10.0)
        diff.close()
        parent.close()
        raise
    finally:
        thread.join(timeout=10.0)
        with contextlib.suppress(OSError):
            reader.close()


def _wait(q: QMP, thread: threading.Thread, settings: PrecopySettings, t0: float,
          stream: _Stream) -> bool:
    """Until the stream is read to its end. A guest that keeps dirtying faster than QEMU
    converges: after max_rounds QEMU is given a downtime limit the rest always fits, so it
    stops the guest itself and sends the rest paused (returns True). QEMU stopping the guest,
    not a QMP `stop`, keeps the stream's device state that of a running guest (its
    globalstate section says "running", as xen-save-devices-state's does)."""
    forced = False
    deadline = t0 + settings.timeout_s
    while thread.is_alive():
        thread.join(timeout=0.02)
        if not thread.is_alive():
            break
        if stream.paused.is_set():  # the guest is stopped: no QMP round trip in its pause
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        elif time.monotonic() <= deadline:
            forced = _poll(q, settings, forced)
        if time.monotonic() > deadline:
            raise VMMError(f"the live copy did not finish in {settings.timeout_s:.0f} s")
    return forced


def _poll(q: QMP, settings: PrecopySettings, forced: bool) -> bool:
    """Check the migration; tell QEMU to finish once it passed max_rounds. Returns forced."""
    st = _status(q)
    status = st.get("status")
    if status in ("failed", "cancelled"):
        raise VMMError(f"the live copy {status}: {st.get('error-desc', 'see qemu.log')}")
    ram = st.get("ram")
    rounds = int(ram.get("dirty-sync-count", 0)) if isinstance(ram, dict) else 0
    if not forced and status == "active" and rounds > settings.max_rounds:
        q.command("migrate-set-parameters", {"downtime-limit": _FORCE_DOWNTIME_MS})
        return True
    return forced


def _hold_rewritten(pid: int, ram: int, diff: Diff) -> int:
    """With the guest paused, read again every page the guest wrote during the copy, raw into
    the diff (compared with the parent by `LiveCopy.settle`, once the guest runs).

    QEMU 7.2 under TCG loses writes from its dirty log: a vCPU keeps a TLB entry that no longer
    traps writes after a dirty-log sync cleared the page's bit, so a page written again later
    may not be re-sent (measured here: a few dozen stale kernel pages per branch of a busy
    guest, and grandchildren that oopsed). A page the guest never wrote during the copy was
    sent once and is exact; one it wrote was sent at least twice (its first write is always
    trapped). Those are read from the paused process: their number is what the guest wrote
    while the copy ran, not the dirty size."""
    idx = diff.rewritten()
    read_pages_in_place(pid, ram, idx, diff.address)
    diff.hold(idx)
    return len(idx)


def _abandon(q: QMP, started: bool) -> None:
    """Cancel a live copy that failed and let the guest run again."""
    with contextlib.suppress(VMMError):
        if started:
            q.command("migrate_cancel")
        deadline = time.monotonic() + 10.0
        while started and time.monotonic() < deadline:
            if _status(q).get("status") not in ("active", "cancelling", "device",
                                                "pre-switchover", "setup"):
                break
            time.sleep(0.005)
        if q.status() in ("paused", "postmigrate", "finish-migrate"):
            q.command("cont")
