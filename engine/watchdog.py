"""The engine's watchdog: enforces sandbox deadlines when no controller daemon runs.

One per ``$FORKD_RUN`` (it holds ``$FORKD_RUN/watchdog.lock`` while it lives, its pid in
the file), started detached by ``ensure_running`` whenever a fork, extend or resume without
a daemon sets a deadline. It sweeps (engine/lifetimes.py) at each deadline and at least
every second, and exits after IDLE_EXIT_S without any deadline left. Run as
``python -P -m forkd.engine.watchdog`` from ``/`` (no checkout can shadow the package);
its output goes to ``$FORKD_RUN/watchdog.log``.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from forkd.engine.lifetimes import next_deadline, sweep_once
from forkd.engine.paths import run_dir
from forkd.names import inert
from forkd.store.store import Store

IDLE_EXIT_S = 10.0  # exit this long after the last deadline is gone
MAX_SLEEP_S = 1.0


def _lock_path() -> str:
    return str(run_dir() / "watchdog.lock")


def running_pid() -> int | None:
    """The pid of this run directory's watchdog, None when none runs."""
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def ensure_running() -> None:
    """Start the watchdog unless one already runs for this $FORKD_RUN."""
    if running_pid() is not None:
        return
    log = open(run_dir() / "watchdog.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        subprocess.Popen([sys.executable, "-P", "-m", "forkd.engine.watchdog"], cwd="/",
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, close_fds=True)
    finally:
        log.close()


def main() -> int:
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another watchdog runs
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    store = Store.open()
    idle_since: float | None = None
    while True:
        try:
            for a in sweep_once(store):
                _log(f"{a.id} {a.action} {a.detail}")
            nd = next_deadline()
        except Exception as e:  # keep watching: the next sweep may succeed
            _log(f"sweep failed: {e}")
            nd = time.time() + MAX_SLEEP_S
        now = time.time()
        if nd is None:
            idle_since = idle_since or now
            if now - idle_since > IDLE_EXIT_S:
                return 0
            time.sleep(MAX_SLEEP_S)
        else:
            idle_since = None
            time.sleep(min(MAX_SLEEP_S, max(0.05, nd - now)))


def _log(text: str) -> None:
    """A line of the watchdog's log; an error in it may carry a guest's words (names.inert)."""
    print(f"{time.strftime('%FT%T')} {inert(text)}".rstrip(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
