"""Small helpers the tests share for processes that listen: a free port, waiting for one
to answer."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import uvicorn

# How long a test waits for what should come within a second or so (a slot freed, a
# request stopped, a thread ended): generous for a loaded 2-CPU machine, and free when
# it comes at once (the waits poll).
PATIENCE_S = 30.0


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at this moment, for a server a test starts next.

    Not one the kernel picks for bind(0): once that socket is closed the kernel may hand
    the same port out at once, as the source port of any outgoing connection on this
    machine (the test's own clients) or to another bind(0), before the server binds it
    (EADDRINUSE, a red test). A random port below the kernel's ephemeral range is never
    a connection's source port; one that is taken fails the bind here and another is
    tried."""
    low, _high = _ephemeral_ports()
    first = 20_000  # above the ports services and Ray's workers (10002-19999) take
    if low - first < 1_000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = first + secrets.randbelow(low - first)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port below {low} on {host}")


def wait_until(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    """Wait until ``GET url/healthz`` answers 200; fail at once if ``proc`` exits first."""

    def up() -> bool:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(what, up, timeout)


@contextlib.contextmanager
def running(web: uvicorn.Server) -> Iterator[None]:
    """``web`` served in a thread of its own while the block runs."""
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_until("uvicorn started", lambda: web.started or not thread.is_alive(), 15)
        assert web.started, "uvicorn did not start (its thread ended): see its log above"
        yield
    finally:
        web.should_exit = True
        thread.join(15)
