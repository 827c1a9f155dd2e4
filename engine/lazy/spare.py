"""A spare lazy server: a process that has loaded the server's modules and waits to be
told which snapshot to serve, so a lazy fork does not wait for an interpreter to start
and import pyfuse3, trio and httpx (about 0.3 s on a 2-core host).

``python3 -m forkd.engine.lazy.spare`` (started detached by ``ensure_spare`` after a lazy
fork, and kept waiting by the controller daemon's ``SpareKeeper``) holds ``spare.lock`` in
``$FORKD_RUN/lazy/``, so at most one waits per run directory, and listens on ``spare.sock``
there (the run directory is private to its user). A lazy fork that finds the socket
connects (``take``):

    spare → taker   "<pid> <its log>\\n"
    taker → spare   one JSON line: {"dir": DIR, "env": {...}, "cwd": CWD}

The spare stops listening at the first connection (one taker), takes the taker's
environment and working directory (so it logs in and resolves paths as a server that
taker started would), and serves DIR as ``python3 -m forkd.engine.lazy.serve DIR`` does.
A taker that hangs up without a line ends it. Unused for ``SPARE_IDLE`` seconds, it exits.
Run as root, it loads at niceness ``LOAD_NICE`` (the children of the fork that started it
take their first steps meanwhile) and is back at its own before it listens. A spare the
daemon started ends with the daemon's keeper thread unless it was taken (the parent-death
signal, SIGTERM, set when it starts and cleared when it is taken: a taken spare serves
children that outlive the daemon).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from forkd.engine.lazy.paths import LAZY_DIR
from forkd.engine.qemu import pid_alive, prctl

SPARE_IDLE = 600.0  # seconds a spare waits for a taker
TAKE_TIMEOUT = 2.0  # seconds a taker waits for the spare's pid, and the spare for its line
MAX_REQUEST = 1 << 20  # bytes of a taker's line (its directory, environment, cwd)
SOCKET, LOCK, PID = "spare.sock", "spare.lock", "spare.pid"
LOAD_NICE = 19  # niceness while a spare loads (then it waits, idle, at its own)
MODULE = "forkd.engine.lazy.spare"
KEEP_EVERY = 5.0  # seconds between the daemon keeper's checks that a spare waits
PARENT_ENV = "FORKD_SPARE_PARENT"  # set by the keeper: the spare ends when that process does
PR_SET_PDEATHSIG = 1


# A server decompresses its working set into fresh 2 MiB buffers (each chunk's bytes) that
# its chunk cache soon drops: glibc hands such blocks back to the kernel (mmap above its
# threshold, heap trimming), so each next chunk faulted its pages in again. Kept in the
# heap instead: python-numpy's 80 memory chunks through a 16-chunk cache took 8,200 page
# faults, not 16,400, and 0.105 s, not 0.13.
SERVER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def server_environment() -> dict[str, str]:
    """The environment a lazy server process starts with (a spare, a ``fork.Spawn``)."""
    return {**os.environ, **SERVER_MALLOC}


def spare_dir(run: Path | None = None) -> Path:
    """Where the spare of ``run`` (default: this process's run directory) waits."""
    from forkd.engine.paths import run_dir

    d = (run or run_dir()) / LAZY_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def ensure_spare(tied: bool = False) -> None:
    """Start a spare unless one waits or loads (it holds the lock; a second one started
    at once exits at the lock). A socket left by a killed spare does not count. ``tied``:
    the spare ends, unless taken, when the thread that calls this ends (SpareKeeper)."""
    d = spare_dir()
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # a spare holds it
    finally:
        os.close(fd)  # (releases the probe's lock)
    fd, log = tempfile.mkstemp(prefix="spare-", suffix=".log", dir=d)
    try:
        env = server_environment()
        if tied:
            env[PARENT_ENV] = str(os.getpid())
        subprocess.Popen([sys.executable, "-P", "-m", MODULE, log], stdin=subprocess.DEVNULL,
                         stdout=fd, stderr=subprocess.STDOUT, start_new_session=True,
                         close_fds=True, env=env)
    finally:
        os.close(fd)


def end_spare(run: Path | None = None) -> bool:
    """End the waiting spare of run directory ``run`` (default: this process's), if any;
    True when one was ended."""
    d = spare_dir(run)
    try:
        pid = int((d / PID).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    if MODULE.encode() not in cmdline:
        return False  # a stale pid file: that number is someone else's now
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    return True


def spares_of(run: Path) -> list[int]:
    """The pids of spares started for run directory ``run`` (waiting or not yet taken):
    what a test checks is gone."""
    want = f"FORKD_RUN={run}".encode()
    found = []
    for p in Path("/proc").iterdir():
        try:
            if (p.name.isdigit() and MODULE.encode() in (p / "cmdline").read_bytes()
                    and want in (p / "environ").read_bytes().split(b"\0")):
                found.append(int(p.name))
        except OSError:
            continue
    return found


def lazy_supported() -> bool:
    """Whether a lazy server can run here: pyfuse3 installed and /dev/fuse present."""
    return importlib.util.find_spec("pyfuse3") is not None and os.path.exists("/dev/fuse")


class SpareKeeper:
    """The controller daemon's spare (``forkd serve``): whenever no spare waits or loads in
    its run directory, it starts one (checked every ``KEEP_EVERY`` seconds), so a lazy
    spawn through the daemon finds a server that has loaded, even after the 10 idle
    minutes a spare waits. Does nothing where lazy servers cannot run (lazy_supported).
    ``stop`` ends its thread, and with it the spare it started if nobody took it."""

    def __init__(self, every: float = KEEP_EVERY) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SpareKeeper:
        if lazy_supported():
            self._thread = threading.Thread(target=self._run, name="forkd-spare", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                ensure_spare(tied=True)
            except OSError as exc:  # the run directory went away or filled up: try again
                print(f"forkd: could not start a spare lazy server: {exc}", file=sys.stderr)
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None


class Taken:
    """A spare taken by this lazy fork: ``go`` tells it its directory. It looks like the
    process a ``fork.Spawn`` starts (``poll``, ``kill``, ``wait``), but is no child of
    this process."""

    def __init__(self, conn: socket.socket, pid: int, log: Path) -> None:
        self.conn = conn
        self.pid = pid
        self.log = log  # its output until it serves (then its directory's server.log)

    @classmethod
    def take(cls) -> Taken | None:
        path = spare_dir() / SOCKET
        if not path.exists():
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(TAKE_TIMEOUT)
        try:
            conn.connect(str(path))
            pid, log = conn.makefile("rb").readline().decode().rstrip("\n").split(" ", 1)
            return cls(conn, int(pid), Path(log))
        except (OSError, ValueError):  # gone, or taken by another fork just now
            conn.close()
            return None

    def go(self, d: Path) -> Taken:
        line = json.dumps({"dir": str(d), "env": dict(os.environ), "cwd": os.getcwd()})
        with contextlib.suppress(OSError):
            self.conn.sendall(line.encode() + b"\n")
        self.conn.close()
        return self

    def cancel(self) -> None:
        self.conn.close()  # it reads EOF and exits

    def poll(self) -> int | None:
        return None if pid_alive(self.pid) else 1

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> None:
        """Not a child: nothing to reap."""


def _wait_for_taker(d: Path) -> socket.socket | None:
    """Listen until the first taker connects (its connection), or None after SPARE_IDLE."""
    path = d / SOCKET
    path.unlink(missing_ok=True)  # a dead spare's: this one holds the lock
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(8)
        # Whole or not there (a new file renamed in): a reader that sees the file reads
        # the number, never an empty file being written (end_spare, the tests' waits).
        tmp = d / f".{PID}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        tmp.replace(d / PID)
        listener.settimeout(SPARE_IDLE)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return None
    finally:
        path.unlink(missing_ok=True)  # one taker: later ones find no socket
        (d / PID).unlink(missing_ok=True)
        listener.close()
    return conn


def _tie_to_parent() -> bool:
    """A spare the daemon's keeper started ends when the keeper does (False: it is gone
    already)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return True
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return str(os.getppid()) == parent  # else it went before the signal was set


def main(log: Path) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ended while it loads or waits
    d = spare_dir()
    lock = os.open(d / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.unlink(missing_ok=True)
            return 0  # another spare waits
        if not _tie_to_parent():
            log.unlink(missing_ok=True)
            return 0
        # it loads while the children of the fork that started it take their first steps:
        # at a low priority (root only: only root may raise it again once taken)
        priority = os.getpriority(os.PRIO_PROCESS, 0)
        lowered = os.geteuid() == 0
        if lowered:
            os.setpriority(os.PRIO_PROCESS, 0, LOAD_NICE)
        from forkd.engine.lazy import serve  # what a spare is for: loaded before it is needed

        serve.warm_up()
        if lowered:
            os.setpriority(os.PRIO_PROCESS, 0, priority)  # a spare taken serves at full speed
        conn = _wait_for_taker(d)
        if conn is not None:  # taken: it serves children that may outlive the daemon
            prctl(PR_SET_PDEATHSIG, 0)
    except SystemExit:  # ended (end_spare, its keeper) while it loaded or waited
        log.unlink(missing_ok=True)
        raise
    finally:
        os.close(lock)  # taken, idle or ended: the next spare may start
    if conn is None:
        log.unlink(missing_ok=True)
        return 0  # idle
    request = None
    with conn:
        conn.settimeout(TAKE_TIMEOUT)
        try:
            conn.sendall(f"{os.getpid()} {log}\n".encode())
            line = conn.makefile("rb").readline(MAX_REQUEST + 1)
            request = json.loads(line) if 0 < len(line) <= MAX_REQUEST else None
        except (OSError, ValueError):
            request = None
    if not (isinstance(request, dict) and isinstance(request.get("dir"), str)
            and isinstance(request.get("env"), dict) and isinstance(request.get("cwd"), str)):
        log.unlink(missing_ok=True)
        return 0  # idle, the taker hung up (it found a server running), or not a request
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    with contextlib.suppress(OSError):
        os.chdir(request["cwd"])
    target = Path(request["dir"])
    serve.adopt_log(target, log)
    return serve.serve(target)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
