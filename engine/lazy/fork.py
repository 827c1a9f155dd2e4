"""``forkd fork HUB/NS/NAME[:TAG] -n N --lazy``: children of a snapshot this host has
never seen, before its pack has arrived.

1. Resolve the chain from the hub's manifests (``chunks.open_remote``: manifests,
   configs, maps and the device state; no chunk). Meanwhile a server process loads
   Python and its modules (``Spawn``: the larger part of a server's start), unless a
   spare one waits already loaded (``spare.py``: each lazy fork leaves one for the next).
   With a recorded access order, the recorded chunks start coming at once: this command
   streams the hub's working-set blob into the new server's spool (``spool.py``) from the
   moment it has the order, and the server checks and serves it as it grows; without
   that blob this command fetches them into the store one by one (``WorkingSetFetch``)
   until the server is up.
2. Start (or find) the snapshot's lazy server (``serve.py``: the memory image as a FUSE
   file, the disk as an NBD export, one per snapshot on the host).
3. Fork the children on its memory file and on copies of its empty overlay, holding the
   file open meanwhile (the server exits once nothing has it open).
4. Let the prefetch start: it fetches the rest of the chain and tags it locally as
   ``NS/NAME:TAG`` once complete.
No image is assembled on this path.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from forkd.engine import children as ch
from forkd.engine.errors import EngineError, HostError
from forkd.engine.lazy import orders
from forkd.engine.lazy.chunks import ChunkSource, open_remote
from forkd.engine.lazy.paths import server_dir
from forkd.engine.lazy.prefetch import RECORDED_WORKERS, load_order, save_order
from forkd.engine.lazy.spare import SERVER_MALLOC, Taken, ensure_spare, server_environment
from forkd.engine.lazy.spool import SPOOL_NAME, Spooler
from forkd.engine.qemu import pid_alive
from forkd.errors import ForkdError
from forkd.names import inert
from forkd.pack.manifest import Descriptor
from forkd.registry import credentials
from forkd.registry.client import RegistryClient
from forkd.registry.reference import RemoteRef, parse_remote
from forkd.store.assembly import Assembled
from forkd.store.blobs import local_path
from forkd.store.manifests import chain_files
from forkd.store.store import Store

READY_TIMEOUT = 120.0  # seconds for a server to mount its file (imports under load)
log = logging.getLogger("forkd.lazy.fork")  # DEBUG: the fork's phases, timed


@dataclass(frozen=True)
class LazySnapshot:
    """A running lazy server's files."""

    dir: Path
    pid: int
    memory: Path
    overlay: Path | None  # an empty child overlay on the disk export
    disk: Path | None  # the disk export's socket

    def prefetch_now(self) -> None:
        (self.dir / "prefetch.go").touch()


def _ready(d: Path) -> LazySnapshot | None:
    try:
        raw = json.loads((d / "ready.json").read_text())
    except (OSError, ValueError):
        return None
    pid = int(raw["pid"])
    if not pid_alive(pid):
        return None
    overlay, disk = raw.get("overlay"), raw.get("disk")
    return LazySnapshot(d, pid, Path(raw["memory"]), Path(overlay) if overlay else None,
                        Path(disk) if disk else None)


class ServerProcess(Protocol):
    """A lazy server's process as start_server watches it (a Popen, or a taken spare)."""

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> object: ...


class Starter(Protocol):
    """What becomes a snapshot's server once told its directory: a ``Spawn`` or a spare
    taken from ``spare.Taken.take``."""

    log: Path

    def go(self, d: Path) -> ServerProcess: ...

    def cancel(self) -> None: ...


class Spawn:
    """A lazy server process started before its snapshot is known: it loads Python and
    the server's modules, then waits for ``go`` to name its directory on its stdin (it
    exits on EOF). Detached, in its own session: it outlives this command. Its output
    goes to a temporary log until it moves to the directory's server.log."""

    def __init__(self) -> None:
        fd, name = tempfile.mkstemp(prefix="forkd-lazy-spawn-", suffix=".log")
        self.log = Path(name)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "forkd.engine.lazy.serve", "-", str(self.log)],
                stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, env=server_environment())
        finally:
            os.close(fd)

    def go(self, d: Path) -> subprocess.Popen[bytes]:
        """Serve the snapshot whose spec is in ``d``."""
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died loading: its log says why
            stdin.write(f"{d}\n".encode())
            stdin.close()
        return self.proc

    def cancel(self) -> None:
        """Not needed (a server was running): end it, before it serves anything."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        self.log.unlink(missing_ok=True)


class Forked:
    """A lazy server forked from this process before its snapshot is known, when no
    other thread runs here (``Forked.start``). It starts with this process's modules
    already loaded (httpx, the registry client, the store: most of what a ``Spawn``
    loads after the interpreter's own start), so it is ready in about a third of a
    ``Spawn``'s time: it loads only the server's own (pyfuse3, trio), then, like a
    ``Spawn``, waits for ``go`` to name its directory on a pipe (it exits at EOF), in a
    session of its own, and outlives this command. Nothing of this process's follows
    it but memory: its descriptors become /dev/null (no lock, socket or file of this
    process is held by the server), its signals and environment are a new process's,
    and it ends with ``os._exit`` (none of this process's exit handlers run)."""

    def __init__(self, log: Path, told: int, pid: int) -> None:
        self.log, self.told, self.pid = log, told, pid
        self.returncode: int | None = None

    @classmethod
    def start(cls) -> Forked | None:
        """A forked server, or None where another thread runs in this process (a fork
        would copy its locks held, not the thread: a ``Spawn`` then)."""
        if not _single_threaded():
            return None
        _reap()
        fd, name = tempfile.mkstemp(prefix="forkd-lazy-spawn-", suffix=".log")
        read, told = os.pipe()
        environment = server_environment()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        try:
            pid = os.fork()
        except OSError:  # no process to be had (a limit): a Spawn says why, if it fails
            pid = -1
        if pid == 0:
            _serve_forked(read, fd, Path(name), environment)
        os.close(read)
        os.close(fd)
        if pid < 0:
            os.close(told)
            Path(name).unlink(missing_ok=True)
            return None
        _forked.add(pid)
        return cls(Path(name), told, pid)

    def go(self, d: Path) -> Forked:
        """Serve the snapshot whose spec is in ``d``."""
        with contextlib.suppress(BrokenPipeError):  # it died loading: its log says why
            os.write(self.told, f"{d}\n".encode())
        self._close()
        return self

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._ended(status)
        return self.returncode

    def wait(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                self._ended(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def cancel(self) -> None:
        """Not needed (a server was running): end it, before it serves anything."""
        self.kill()
        self.wait()
        self._close()
        self.log.unlink(missing_ok=True)

    def _ended(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        _forked.discard(self.pid)

    def _close(self) -> None:
        if self.told >= 0:
            os.close(self.told)
            self.told = -1


_forked: set[int] = set()  # forked servers not waited for yet (they outlive their command)


def _reap() -> None:
    """Wait for the forked servers of this process that have ended (no zombie stays)."""
    for pid in list(_forked):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        _forked.discard(pid)


def _single_threaded() -> bool:
    """No other thread runs in this process: Python's, or a library's own (the kernel's
    list of this process's tasks)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


# glibc reads its MALLOC_*_ environment at a process's start: a forked server sets the
# same numbers (spare.SERVER_MALLOC) with mallopt
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
PR_SET_NAME = 15  # prctl: this thread's (the process's) name, 15 bytes at most
SERVER_NAME = b"forkd-lazy"


def _serve_forked(told: int, log_fd: int, log: Path, environment: dict[str, str]) -> NoReturn:
    """The forked child: become a new process's server (see ``Forked``), then serve."""
    code = 1
    try:
        os.setsid()
        libc = ctypes.CDLL(None)
        # its name in ps -e, top and pgrep (its command line stays its command's)
        libc.prctl(PR_SET_NAME, SERVER_NAME, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in (0, 1, 2, told, null):
                with contextlib.suppress(OSError):  # the listing's own, closed since
                    os.dup2(null, fd, inheritable=False)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD,
                       signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(environment)
        for variable, param in _MALLOPT.items():
            libc.mallopt(param, int(SERVER_MALLOC[variable]))
        for handler in logging.root.handlers[:]:  # this process's: to files now /dev/null
            logging.root.removeHandler(handler)
        gc.freeze()  # this process's objects: not collected, so their pages stay shared
        from forkd.engine.lazy.serve import serve_when_told

        code = serve_when_told(told, log)
    except BaseException:  # said in its log, then the process ends
        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def start_server(store: Store, source: ChunkSource, remote: RemoteRef | None,
                 tag: str | None, prefetch: bool = True,
                 spawn: Starter | None = None,
                 working_set: Descriptor | None = None,
                 spooler: Spooler | None = None,
                 record_pages: bool = False) -> LazySnapshot:
    """The lazy server of ``source``'s head: the running one, else a new one (detached,
    in its own session: it outlives this command), ``spawn``'s process when given (it
    is ended when a server runs). prefetch False: a new server fetches only what readers
    ask for; ``working_set``: the blob a new server fetches the recorded chunks in
    (``spooler``: from the file this command streams it into; removed when a server runs
    already); record_pages: a new server that records the pages read (record.py), never
    a running one."""
    from forkd.engine.lazy.serve import ServerSpec  # the server's own modules need pyfuse3

    d = server_dir(store.home, source.head)
    found = _ready(d)
    if found is not None and record_pages:
        if spawn is not None:
            spawn.cancel()
        raise HostError(f"a lazy server of {source.name} runs (pid {found.pid}), so the "
                        "pages a new child touches cannot be recorded; kill its children "
                        "(forkd kill) and record again")
    if found is not None:
        if spawn is not None:
            spawn.cancel()
        if spooler is not None:
            spooler.discard()
        return found
    d.mkdir(parents=True, exist_ok=True)
    ServerSpec(str(store.home), source.head, source.name, tag,
               remote.hub.address if remote else None, remote.name if remote else None,
               prefetch, working_set.to_json() if working_set else None,
               str(spooler.path) if spooler is not None and working_set else None,
               record_pages).save(d)
    proc: ServerProcess
    if spawn is not None:
        proc = spawn.go(d)
    else:
        with (d / "server.log").open("ab") as log:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "forkd.engine.lazy.serve",
                                     str(d)], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True, env=server_environment())
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        found = _ready(d)
        if found is not None:
            return found
        if proc.poll() not in (None, 0):
            break
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            proc.kill()
    proc.wait()
    if spooler is not None:
        spooler.discard()
    log_file = d / "server.log"
    if spawn is not None and spawn.log.exists():  # it died before moving to server.log
        log_file = spawn.log
    tail = log_file.read_text(errors="replace").splitlines()[-15:] if log_file.exists() else []
    raise HostError(f"the lazy server of {source.name} did not start (log {log_file}):\n"
                    + inert("\n".join(tail)))


@contextlib.contextmanager
def holding(store: Store, source: ChunkSource, remote: RemoteRef | None, tag: str | None,
            prefetch: bool = True, spawn: Starter | None = None,
            working_set: Descriptor | None = None,
            spooler: Spooler | None = None,
            record_pages: bool = False) -> Iterator[LazySnapshot]:
    """A serving lazy server whose memory file is held open meanwhile (the server serves
    on while a file is open); ``spawn``: the process a new server runs in; the rest as
    start_server's. A server found just as it exits is waited for, and a new one started."""
    for _ in range(3):
        snap = start_server(store, source, remote, tag, prefetch, spawn, working_set, spooler,
                            record_pages)
        spawn = spooler = None  # used or ended
        try:
            fd = os.open(snap.memory, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0 and (snap.dir / "ready.json").exists():
            break
        if fd >= 0:
            os.close(fd)
        deadline = time.monotonic() + READY_TIMEOUT
        while pid_alive(snap.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # it was exiting: let it unmount
    else:
        raise HostError(f"the lazy server of {source.name} exits as it is found; see "
                        f"{server_dir(store.home, source.head) / 'server.log'}")
    try:
        yield snap
    finally:
        os.close(fd)


def assembled(store: Store, source: ChunkSource, snap: LazySnapshot) -> Assembled:
    """What children.fork needs, on the lazy server's files (no image assembled)."""
    files = chain_files(source.chain)
    vmstate = files.get("vmstate")
    path = local_path(store.blobs, vmstate.digest) if vmstate else None
    return Assembled(source.head, source.config, snap.memory, snap.disk, path, {})


def fork(store: Store, remote_text: str, n: int, *, prefetch: bool = True,
         **options: Any) -> ch.ForkResult:
    """N children of ``remote_text`` (``[HUB/]NS/NAME[:TAG]``) before its pack is here;
    ``options`` as children.fork's. prefetch False: chunks arrive on demand only (a new
    server's setting)."""
    remote = parse_remote(remote_text)
    t0 = time.perf_counter()
    # a spare server (loaded: an earlier lazy fork or the daemon left it), else a new
    # process that loads while the chain is resolved: forked from this one where it can be
    spawn: Starter = Taken.take() or Forked.start() or Spawn()
    with RegistryClient(remote.hub, credentials.load(remote.hub.host)) as client:
        spooler: Spooler | None = None
        try:
            head_manifest = client.get_manifest(remote.name, remote.tag)
            head = head_manifest[1]
            d = server_dir(store.home, head)
            order = load_order(d / "order.json", head)

            def spool(working_set: Descriptor | None) -> None:
                """The working set's blob streams into the new server's spool at once."""
                nonlocal spooler
                if working_set is not None and prefetch and _ready(d) is None:
                    spooler = Spooler(client, remote.name, working_set, d / SPOOL_NAME)

            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="order") as pool:
                # recorded by an earlier lazy fork, on any host: looked up meanwhile
                found = pool.submit(orders.fetch, client, remote.name, head, spool) \
                    if order is None else None
                if order is not None:
                    spool(order.working_set)
                source = open_remote(store, remote, client, head_manifest)
                if found is not None:
                    order = found.result()
                    if order is not None and order.chunks:
                        d.mkdir(parents=True, exist_ok=True)
                        save_order(d / "order.json", head, order)
            if spooler is not None and (order is None or order.working_set is None):
                spooler.discard()  # the order itself did not come: no server reads it
                spooler = None
        except BaseException:
            spawn.cancel()
            if spooler is not None:
                spooler.discard()
                spooler.wait()  # its stream ends before the client it streams through
            raise
        log.debug("lazy fork %s: chain resolved at %.3f s", remote_text,
                  time.perf_counter() - t0)
        working_set = order.working_set if order is not None else None
        # with a working-set blob it streams into the new server's spool from the order's
        # arrival on; without, this command fetches the recorded chunks one by one
        fetch = WorkingSetFetch(source, order.chunks if order and prefetch and not working_set
                                and _new_server(store, source) else None)
        try:
            res = _fork_on_server(store, source, remote, n, prefetch, spawn, t0, options,
                                  fetch.stop, working_set, spooler)
        finally:
            fetch.stop()
            if spooler is not None:
                spooler.wait()  # the server reads it as it grows: all of it is there
    ensure_spare()  # for the next lazy fork on this host
    return res


class WorkingSetFetch:
    """While a new server still loads, this command already fetches the recorded working
    set (``order``) into the store, in order, so the server finds it local (best effort:
    a chunk it misses is fetched when read). ``stop`` once the server is up (it fetches
    the rest itself, from the front of the same order, so going on would fetch chunks
    twice): chunks not started are dropped, the ones on their way are waited for."""

    def __init__(self, source: ChunkSource, order: list[str] | None) -> None:
        self.pool: ThreadPoolExecutor | None = None
        if not order:
            return
        self.pool = ThreadPoolExecutor(max_workers=RECORDED_WORKERS,
                                       thread_name_prefix="working-set")

        def one(digest: str) -> None:
            with contextlib.suppress(ForkdError):
                source.fetch_into_store(digest)

        for digest in order:
            if digest in source.refs:
                self.pool.submit(one, digest)

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _new_server(store: Store, source: ChunkSource) -> bool:
    """No server of this snapshot runs yet (one that does has its chunks coming)."""
    return _ready(server_dir(store.home, source.head)) is None


def _fork_on_server(store: Store, source: ChunkSource, remote: RemoteRef, n: int,
                    prefetch: bool, spawn: Starter, t0: float, options: dict[str, Any],
                    on_ready: Callable[[], None],
                    working_set: Descriptor | None,
                    spooler: Spooler | None = None) -> ch.ForkResult:
    tag = f"{remote.name}:{remote.tag}"
    with holding(store, source, remote, tag if _may_tag(store, tag, source) else None,
                 prefetch, spawn, working_set, spooler) as snap:
        log.debug("lazy fork %s: server ready at %.3f s (started as %s)", remote,
                  time.perf_counter() - t0, type(spawn).__name__)
        on_ready()
        try:
            asm = assembled(store, source, snap)
            res = ch.fork(store, tag, n, assembled=asm, overlay_template=snap.overlay,
                          **options)
            log.debug("lazy fork %s: %d children forked at %.3f s", remote,
                      len(res.children), time.perf_counter() - t0)
        except EngineError as exc:
            raise type(exc)(f"{exc}{_failures(snap)}") from exc
        finally:
            if prefetch:
                snap.prefetch_now()
    if res.errors:
        res = ch.ForkResult(res.children, res.assemble_ms, res.total_ms,
                            [*res.errors, *_failures(snap).splitlines()[1:]])
    return res


def _may_tag(store: Store, tag: str, source: ChunkSource) -> bool:
    """The chain may get the local tag (none yet, or the same content)."""
    return store.tags.read().get(tag, source.head) == source.head


def _failures(snap: LazySnapshot) -> str:
    try:
        errors = json.loads((snap.dir / "errors.json").read_text())
    except (OSError, ValueError):
        return ""
    return "".join(f"\nlazy read failed: {msg}" for msg in dict(errors).values())


__all__ = ["Forked", "LazySnapshot", "Spawn", "assembled", "fork", "start_server"]
