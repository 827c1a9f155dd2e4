"""The controller daemon for the tests that drive it: `forkd serve --listen` on a free
loopback port, or `forkd serve` on its unix socket."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import uvicorn
from net_support import free_port, wait_healthy, wait_until


@contextlib.contextmanager
def tcp_daemon(env: Mapping[str, str], log: Path, *args: str, timeout: float = 30) -> Iterator[str]:
    """Start the daemon with ``env`` over the environment, its output in ``log``; yield its
    URL once /healthz answers; stop it (SIGTERM, then wait) however the block ends."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(["forkd", "serve", "--listen", f"127.0.0.1:{port}", *args],
                                env={**os.environ, **env}, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, "forkd serve", timeout)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def socket_daemon(
    env: Mapping[str, str], log: Path, timeout: float = 60
) -> subprocess.Popen[bytes]:
    """Start `forkd serve` on its unix socket ($FORKD_RUN/controller.sock) with exactly
    ``env``; return it once /healthz answers there (the caller stops it)."""
    sock = Path(env["FORKD_RUN"], "controller.sock")
    with log.open("ab") as out:
        proc = subprocess.Popen(["forkd", "serve"], env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out)

    def up() -> bool:
        assert proc.poll() is None, f"forkd serve exited with {proc.returncode}; see {log}"
        if not sock.exists():
            return False
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                              base_url="http://forkd") as probe:
                return probe.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(f"forkd serve on {sock}", up, timeout)
    return proc


@contextlib.contextmanager
def running(web: uvicorn.Server) -> Iterator[None]:
    """``web`` served in a thread of its own while the block runs."""
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_until("uvicorn started", lambda: web.started, 15)
        yield
    finally:
        web.should_exit = True
        thread.join(15)
