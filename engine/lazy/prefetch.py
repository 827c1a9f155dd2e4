"""Record the order children touch a snapshot's chunks, and fetch the rest of its chain
in that order in the background (REAP's record-and-prefetch, per chunk).

``AccessOrder`` notes each chunk the first time a reader (the memory file, the disk
export) needs it, and each 2 MiB window of the memory image the first time a read
reaches it. The first run that finds no recorded order saves what it saw (``order.json``
in the snapshot's lazy directory, and as an optional blob of the pack:
docs/pack-format.md, "Access order"); later runs push the recorded windows' holes into
the page cache (``memfs.push_zeros``) and prefetch in that order: the recorded chunks
first, then every other chunk of the chain in image order (memory, then disk), then the
whole-file blobs. Once nothing is missing the chain is tagged locally, so the snapshot
forks, branches and pushes like a pulled one; children keep running unchanged (they read
the same bytes, now from the store).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forkd.engine.lazy import spool as spooled
from forkd.engine.lazy import workingset
from forkd.engine.lazy.chunks import ChunkSource
from forkd.errors import Conflict, ForkdError
from forkd.pack import accessorder
from forkd.pack.accessorder import Order
from forkd.pack.manifest import Descriptor

PREFETCH_WORKERS = 2  # fetches at once for the chunks past the recorded working set
RECORDED_WORKERS = 4  # fetches at once for the recorded working set (HTTP connections)
BACKGROUND_NICE = 19  # niceness of the threads that fetch the rest of the chain
BACKGROUND_SETTLE = 0.5  # seconds the rest waits once the children are started
COMPLETE_WAIT = 300.0  # seconds a branch of a lazy child waits for its chain


class AccessOrder:
    """The chunks of one snapshot, and the windows of its memory image, in the order
    readers first needed them; thread-safe."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self.windows: list[int] = []
        self._seen: set[str] = set()
        self._seen_windows: set[int] = set()
        self._lock = threading.Lock()

    def note(self, digests: Iterable[str]) -> None:
        with self._lock:
            for d in digests:
                if d not in self._seen:
                    self._seen.add(d)
                    self.digests.append(d)

    def note_window(self, window: int) -> None:
        with self._lock:
            if window not in self._seen_windows:
                self._seen_windows.add(window)
                self.windows.append(window)

    def recorded(self) -> Order:
        with self._lock:
            return Order(list(self.digests), list(self.windows))


def load_order(path: Path, head: str) -> Order | None:
    """A saved order, or None when there is none (or it is unusable: the default applies)."""
    try:
        return accessorder.decode(path.read_bytes(), head, str(path))
    except (OSError, ForkdError):
        return None


def save_order(path: Path, head: str, order: Order) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(accessorder.encode(head, order))
    tmp.replace(path)


@dataclass
class Progress:
    """What the prefetch did (written as JSON next to the server's other files)."""

    state: str = "waiting"  # waiting, running, done, failed
    chunks: int = 0  # chunks of the chain
    fetched: int = 0  # chunks it fetched
    fetched_bytes: int = 0
    recorded: int = 0  # chunks fetched in the recorded order
    streamed: int = 0  # of those, the chunks that came in the working set's one request
    recorded_seconds: float = 0.0  # until the recorded working set was here (pushed)
    tagged: str | None = None
    error: str | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def plan(source: ChunkSource, recorded: list[str] | None, image_order: list[str]) -> list[str]:
    """Every chunk of the chain, the recorded ones first (those the chain has)."""
    known = set(source.refs)
    out = [d for d in dict.fromkeys(recorded or []) if d in known]
    listed = set(out)
    out += [d for d in dict.fromkeys([*image_order, *source.refs]) if d not in listed]
    return out


def run(source: ChunkSource, order: list[str], recorded: int, progress: Progress,
        report: Path, tag: str | None,
        on_chunk: Callable[[str, bytes], object] | None = None,
        handed: Iterable[str] = (), working_set: Descriptor | None = None,
        before_rest: Callable[[], object] | None = None,
        spool: Path | None = None) -> None:
    """Fetch what ``order`` names and the store lacks, then the files; tag when complete.
    ``on_chunk``: given each chunk of ``handed`` (local or fetched) decompressed and
    verified, as it arrives (the memory file pushes it into the page cache);
    ``working_set``: the recorded chunks' blob, fetched first in one request (or read from
    ``spool`` as the fork command streams it in: spool.py; removed once read);
    ``before_rest``: called (it may wait) between the recorded chunks and the rest."""
    t0 = time.monotonic()
    progress.state, progress.chunks, progress.recorded = "running", len(order), recorded
    _save(report, progress)
    lock = threading.Lock()
    to_hand = set(handed) if on_chunk is not None else set()

    def one(digest: str) -> None:
        if digest in to_hand and on_chunk is not None:
            fetched = not source.local(digest)
            on_chunk(digest, source.read(digest, keep=False))
        else:
            fetched = source.ensure(digest)
        if fetched:
            with lock:
                progress.fetched += 1
                progress.fetched_bytes += source.ref(digest).stored

    try:
        first = order[:recorded]  # what the children are about to fault on
        later = order[recorded:]
        if working_set is not None:
            # the recorded chunks past the working set (what only the recording child's
            # read-ahead needed, engine/lazy/record.py) wait with the rest: a child that
            # reads one fetches it then
            held = _held(source, working_set, first)
            first, later = first[:held], first[held:] + later
            try:
                brought = workingset.fetch(source, working_set, first, on_chunk, to_hand,
                                           spool)
            except ForkdError as exc:  # it does not fit the order: chunk by chunk
                progress.errors.append(str(exc))
                brought = []
            finally:
                if spool is not None:
                    spooled.remove(spool)
            progress.streamed = len(brought)
            with lock:
                progress.fetched += len(brought)
                progress.fetched_bytes += sum(source.ref(d).stored for d in brought)
            got = set(brought)
            first = [d for d in first if d not in got]
        with ThreadPoolExecutor(max_workers=RECORDED_WORKERS) as pool:
            list(pool.map(one, first))
        progress.recorded_seconds = round(time.monotonic() - t0, 3)
        _save(report, progress)
        if before_rest is not None:
            before_rest()
        with ThreadPoolExecutor(max_workers=PREFETCH_WORKERS, initializer=_background) as pool:
            list(pool.map(one, later))  # what no child needed yet
        progress.fetched_bytes += source.fetch_files()
        source.flush()  # the fetched chunks are in the store
        # a chunk that came into the store by its digest alone (the fork command's
        # WorkingSetFetch, a pull killed before its check) is checked before the chain
        # is called whole: a pack `forkd pull` refuses is never tagged here
        with ThreadPoolExecutor(max_workers=PREFETCH_WORKERS, initializer=_background) as pool:
            list(pool.map(source.check, source.unchecked()))
        if not source.complete():
            raise ForkdError(f"{source.name}: blobs are still missing after the prefetch")
        if tag is not None:
            source.store.tag(tag, source.head)
            progress.tagged = tag
        progress.state = "done"
    except ForkdError as exc:
        progress.state, progress.error = "failed", str(exc)
    progress.seconds = round(time.monotonic() - t0, 3)
    _save(report, progress)


def _held(source: ChunkSource, blob: Descriptor, order: list[str]) -> int:
    """How many of the first chunks of ``order`` working-set ``blob`` holds (all of
    ``order`` when it does not fit: workingset.fetch does not use it then)."""
    try:
        return len(workingset.held_chunks(source, blob, order))
    except ForkdError:
        return len(order)


def _background() -> None:
    """This thread yields the CPU to the children (and to the faults they still take):
    the rest of the chain is not what they wait for (Linux: niceness is per thread)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def _save(report: Path, progress: Progress) -> None:
    tmp = report.with_name(report.name + ".tmp")
    tmp.write_text(json.dumps(asdict(progress)))
    tmp.replace(report)


def read_progress(report: Path) -> Progress | None:
    try:
        raw = json.loads(report.read_text())
    except (OSError, ValueError):
        return None
    return Progress(**raw) if isinstance(raw, dict) else None


def wait_complete(memory: str | Path, what: str, timeout: float = COMPLETE_WAIT) -> None:
    """For a child of a lazy server (its memory file is the server's): wait until the
    prefetch has brought the whole chain and tagged it, since a branch stacks a layer on
    that tag; raise, saying why, when it failed, cannot complete (the server fetches on
    demand only) or is still running after ``timeout`` seconds. Any other child: return."""
    from forkd.engine.lazy.paths import server_dir_of

    d = server_dir_of(Path(memory))
    if d is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        got = read_progress(d / "prefetch.json")
        if got is not None and got.state == "done":
            return
        if got is not None and got.state == "failed":
            raise ForkdError(f"{what} was forked lazily and its chain did not arrive "
                             f"({got.error}); fork it again while its hub is reachable, or "
                             "pull the pack")
        try:
            on_demand = json.loads((d / "server.json").read_text()).get("prefetch") is False
        except (OSError, ValueError):
            on_demand = False
        if on_demand:
            raise Conflict(f"{what} was forked lazily with the prefetch off, so its chain is "
                           "not complete here; pull the pack (forkd pull), then branch")
        if time.monotonic() > deadline:
            fetched = f"{got.fetched} of {got.chunks} chunks" if got else "nothing yet"
            raise Conflict(f"{what} was forked lazily and its chain is still arriving "
                           f"({fetched} after {timeout:.0f} s; {d / 'prefetch.json'}); "
                           "branch it once that says done")
        time.sleep(0.1)
