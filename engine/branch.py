"""`forkd branch`: a diff layer from a running child, with a short pause.

Live (the default, engine/precopy.py): QEMU's precopy migration streams the guest RAM while
the guest runs and re-sends what it writes meanwhile; the reader keeps only the pages that
differ from the parent image. QEMU pauses the guest for the last few pages and the device
sections (the branch's device state); in that pause the pages the guest wrote during the copy
are read again and the child's disk overlay copied, then the guest resumes (`cont`).

Stop-the-world (live=False, the baseline of bench/fork_fanout.py): pause (QMP stop) → scan
/proc/PID/pagemap of the guest-RAM mapping: present and not file-backed = a page the child
wrote → copy those pages with process_vm_readv into a pre-touched buffer → save device state
→ copy the disk overlay → resume.

Either way, with the child running again, the pages are stored as a diff layer whose parent is
the child's snapshot.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.engine import children as ch
from forkd.engine import precopy
from forkd.engine.build import scratch_dir
from forkd.engine.errors import ChildDead, HostError, VMMError
from forkd.engine.lazy.prefetch import wait_complete
from forkd.engine.precopy import PAGE, ram_mapping, read_pages
from forkd.engine.qemu import QEMU_IMG, pid_alive
from forkd.engine.qmp import QMP
from forkd.errors import Conflict, ForkdError
from forkd.names import parse_ref
from forkd.store.blobs import free_space
from forkd.store.fetch import check_free, check_room
from forkd.store.store import Store

_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61


@dataclass(frozen=True)
class BranchResult:
    ref: str
    digest: str
    parent: str
    mode: str  # "live" (precopy, the default) or "stop" (stop-the-world)
    pause_ms: float  # guest paused: QEMU's STOP → RESUME events (host clock if missing)
    pause_pages: int  # guest pages copied while it was paused
    copy_ms: float  # live: the copy while the guest ran, up to its pause; stop: 0
    rounds: int  # live: QEMU's dirty-log rounds; stop: 1
    forced: bool  # live: the guest kept writing, stopped after max_rounds to finish
    scan_ms: float  # stop: pagemap scan in the pause
    read_ms: float  # stop: process_vm_readv in the pause
    devstate_ms: float  # stop: xen-save-devices-state in the pause
    diff_pages: int
    diff_bytes: int
    stored_bytes: int
    store_ms: float
    depth: int
    compacted: bool


def anon_kib(pid: int, mem_path: Path) -> int:
    """`Anonymous` kB of the RAM mapping (the copy-on-write cost of the child)."""
    real = str(mem_path.resolve())
    cur = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                cur = line.rstrip().endswith(real)
            elif cur and first == "Anonymous:":
                return int(line.split()[1])
    return 0


def _pagemap(pid: int, start: int, end: int) -> array.array[int]:
    """The pagemap entries of the pages in [start, end) of process ``pid``."""
    n = (end - start) // PAGE
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(start // PAGE * 8)
        a = array.array("Q")
        a.frombytes(f.read(n * 8))
    return a


def dirty_pages(pid: int, start: int, end: int) -> list[int]:
    """Indices of pages in [start, end) that are private copies (written by the guest)."""
    return [i for i, e in enumerate(_pagemap(pid, start, end))
            if e & (_PRESENT | _SWAPPED) and not e & _FILE]


def touched_pages(pid: int, start: int, end: int) -> list[int]:
    """Indices of pages in [start, end) the process has mapped: read or written by the
    guest (a file page it read, or its private copy of one it wrote), and the neighbours
    of each that the kernel's fault-around mapped with it (up to 64 KiB around a fault,
    pages already in the page cache)."""
    return [i for i, e in enumerate(_pagemap(pid, start, end)) if e & (_PRESENT | _SWAPPED)]


def save_device_state(q: QMP, path: Path) -> None:
    """xen-save-devices-state into a file the host opens and hands over as an fd set
    (QEMU may run as an unprivileged user that cannot create files in our work dir)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        added = q.command("add-fd", fds=[fd])
    finally:
        os.close(fd)
    fdset = int(added["fdset-id"])
    try:
        q.command("xen-save-devices-state", {"filename": f"/dev/fdset/{fdset}", "live": False})
    finally:
        with contextlib.suppress(VMMError):
            q.command("remove-fd", {"fdset-id": fdset})


def _pause_ms(events: list[dict[str, Any]], fallback_ms: float) -> float:
    """The guest's pause from QEMU's own STOP and RESUME events (microsecond timestamps)."""
    def at(name: str) -> float | None:
        for ev in events:
            if ev.get("event") == name and isinstance(ev.get("timestamp"), dict):
                ts = ev["timestamp"]
                return float(ts["seconds"]) + float(ts["microseconds"]) / 1e6
        return None

    stop, resume = at("STOP"), at("RESUME")
    if stop is None or resume is None or resume < stop:
        return fallback_ms
    return (resume - stop) * 1000


def _resume(q: QMP, child_id: str) -> None:
    try:
        q.command("cont")
    except VMMError as e:
        raise VMMError(f"child {child_id} stays paused after the branch: {e}. Its state is "
                       f"intact; retry `cont` on its QMP socket or `forkd kill {child_id}`.") from e


@dataclass
class _Copied:
    """What the pause produced, before it goes into the store."""

    pages: Iterable[tuple[int, bytes]]
    count: int
    pause_ms: float
    pause_pages: int
    copy_ms: float = 0.0
    rounds: int = 1
    forced: bool = False
    scan_ms: float = 0.0
    read_ms: float = 0.0
    devstate_ms: float = 0.0


def _copy_live(q: QMP, info: ch.ChildInfo, devstate: Path, overlay_copy: Path,
               settings: precopy.PrecopySettings) -> tuple[_Copied, precopy.LiveCopy]:
    """The pause holds QEMU's last round, the re-read of rewritten pages and the overlay copy;
    the rest waits until the guest runs again."""
    first_event = len(q.events)
    lc = precopy.live_copy(q, info.pid, Path(info.memory), info.memory_mib << 20, settings)
    try:
        t = time.monotonic()
        try:
            # the overlay holds the child's writes; QEMU flushed it when the migration ended
            shutil.copyfile(info.path / "disk.qcow2", overlay_copy)
        finally:
            _resume(q, info.id)
        resumed_ms = (time.monotonic() - t) * 1000
        lc.settle(q)
        devstate.write_bytes(lc.device_state)
        host_ms = lc.qemu_downtime_ms + resumed_ms
    except BaseException:
        lc.close()
        raise
    copied = _Copied(pages=lc.diff.items(), count=lc.diff.count(),
                     pause_ms=_pause_ms(q.events[first_event:], host_ms),
                     pause_pages=lc.pause_records, copy_ms=lc.copy_ms, rounds=lc.rounds,
                     forced=lc.forced)
    return copied, lc


def _copy_stopped(q: QMP, info: ch.ChildInfo, devstate: Path, overlay_copy: Path) -> _Copied:
    mem = Path(info.memory)
    start, end, off = ram_mapping(info.pid, mem)
    if off != 0:
        raise HostError(f"unexpected RAM mapping offset {off} in child {info.id}")
    # pre-touch a buffer for the copy, sized from the current CoW estimate + slack
    est = anon_kib(info.pid, mem) * 1024 + (16 << 20)
    buf = ctypes.create_string_buffer(est)
    ctypes.memset(buf, 1, est)
    first_event = len(q.events)
    t0 = time.monotonic()
    q.command("stop")
    try:
        idx = dirty_pages(info.pid, start, end)
        t_scan = time.monotonic()
        need = len(idx) * PAGE
        if need > est:
            buf = ctypes.create_string_buffer(need)
        read_pages(info.pid, start, idx, buf)
        t_read = time.monotonic()
        save_device_state(q, devstate)
        t_dev = time.monotonic()
        # the overlay holds the child's writes; QEMU flushed it on stop
        shutil.copyfile(info.path / "disk.qcow2", overlay_copy)
    finally:
        _resume(q, info.id)
    t_cont = time.monotonic()
    view = memoryview(buf).cast("B")
    pages = ((i, bytes(view[k * PAGE:(k + 1) * PAGE])) for k, i in enumerate(idx))
    return _Copied(pages=pages, count=len(idx),
                   pause_ms=_pause_ms(q.events[first_event:], (t_cont - t0) * 1000),
                   pause_pages=len(idx), scan_ms=(t_scan - t0) * 1000,
                   read_ms=(t_read - t_scan) * 1000, devstate_ms=(t_dev - t_read) * 1000)


# seconds a failed branch waits for its child's QEMU to be gone before saying the failure
# is its own: a kill's SIGKILL closes QEMU's sockets (the branch's QMP read fails at once)
# before the process is a zombie, so a check at once found it alive and the branch said
# "connection reset" for a child that a kill had ended
ENDING_GRACE = 2.0


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) now or within ``seconds``."""
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _check_room(store: Store, info: ch.ChildInfo, work: Path) -> None:
    """NoRoom before anything is copied when what a branch of ``info`` may write does not
    fit, keeping the reserve (fetch.check_room): at most its whole memory and its overlay's
    allocated bytes into the store, the overlay copied and converted to raw in ``work``.
    A branch (a pause too) wrote until the disk was full: a guest that dirtied its memory
    and filled its disk, branched again and again under new tags (branch_sandbox, an MCP
    client's to call), filled the filesystem every sandbox, pause and pull of the host
    shares, as a pull that cannot fit no longer may."""
    try:
        disk = (Path(info.dir) / "disk.qcow2").stat().st_blocks * 512
    except OSError:
        disk = 0  # no overlay to copy: the copy fails, saying so
    check_free(free_space(work), 2 * disk, f"branching child {info.id} (its disk, copied "
               "and converted)", work)
    check_room(store, (info.memory_mib << 20) + disk, f"branching child {info.id} (its "
               f"{info.memory_mib} MiB of memory and its disk's changes, at most)")


def branch(store: Store, child_id: str, tag: str, *, force: bool = False, live: bool = True,
           settings: precopy.PrecopySettings | None = None) -> BranchResult:
    """A diff layer `tag` from the running child: live (copy while it runs, pause for the
    rest) or, with live=False, stop-the-world."""
    ref = str(parse_ref(tag))
    info = ch.get(child_id)
    ch._require_running(info)
    wait_complete(info.memory, f"child {child_id}")  # a lazy child: its chain arrives first
    if store.resolve(info.ref) != info.digest:
        raise Conflict(f"tag {info.ref} has moved since child {child_id} was forked from it; "
                       "the diff would have the wrong parent. Re-tag the old digest first.")
    work = scratch_dir("forkd-branch")
    live_copy: precopy.LiveCopy | None = None
    try:
        _check_room(store, info, work)
        devstate = work / "vmstate"
        overlay_copy = work / "disk.qcow2"
        try:
            with ch.locked(info), ch.qmp(info) as q:
                if live:
                    copied, live_copy = _copy_live(q, info, devstate, overlay_copy,
                                                   settings or precopy.PrecopySettings())
                else:
                    copied = _copy_stopped(q, info, devstate, overlay_copy)
        except (ForkdError, OSError) as e:
            if not _ends_within(info.pid, ENDING_GRACE):
                raise
            # killed (a kill waits only so long for a branch) or crashed mid-copy: the
            # child's state is gone, whatever the failed step said about it
            raise ChildDead(f"child {child_id} ended during the branch (killed, or its QEMU "
                            f"exited): nothing was stored under {ref}; the step it cut "
                            f"short said: {e}") from e
        disk_raw = work / "disk.raw"
        p = subprocess.run([QEMU_IMG, "convert", "-f", "qcow2", "-O", "raw", str(overlay_copy),
                            str(disk_raw)], capture_output=True, text=True, check=False,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise VMMError(f"qemu-img convert of child {child_id}'s disk failed: "
                           f"{p.stderr.strip()}")
        t_store = time.monotonic()
        layer = store.import_pages(ref, parent=info.ref, pages=copied.pages, vmstate=devstate,
                                   disk=disk_raw, description=f"branch of {child_id}",
                                   force=force)
        store_ms = (time.monotonic() - t_store) * 1000
        return BranchResult(
            ref=ref, digest=layer.digest, parent=info.ref, mode="live" if live else "stop",
            pause_ms=copied.pause_ms, pause_pages=copied.pause_pages, copy_ms=copied.copy_ms,
            rounds=copied.rounds, forced=copied.forced, scan_ms=copied.scan_ms,
            read_ms=copied.read_ms, devstate_ms=copied.devstate_ms,
            diff_pages=copied.count, diff_bytes=copied.count * PAGE,
            stored_bytes=layer.stored_bytes, store_ms=store_ms, depth=layer.depth,
            compacted=layer.compacted)
    finally:
        if live_copy is not None:
            live_copy.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
