"""Small helpers the tests share for processes that listen: a free port, waiting for one
to answer."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at this moment."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
