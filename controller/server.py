"""Running the controller daemon: a Unix socket (mode 0600) and, optionally, TCP with a token."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvicorn
from litestar import Litestar

from forkd.audit import AuditLog
from forkd.controller.app import ControllerMetrics, create_app
from forkd.controller.backend import LocalBackend
from forkd.controller.client import RemoteBackend, default_socket
from forkd.engine.paths import run_dir
from forkd.engine.pool import Pool
from forkd.errors import Conflict, InvalidInput
from forkd.store.store import Store


def token_path() -> Path:
    return run_dir() / "controller.token"


def load_or_create_token(path: Path | None = None) -> str:
    """The TCP bearer token: from FORKD_CONTROLLER_TOKEN, else a file made once (mode 0600)."""
    env = os.environ.get("FORKD_CONTROLLER_TOKEN")
    if env:
        return env
    path = path or token_path()
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _unix_listener(path: Path) -> socket.socket:
    if path.exists():
        if RemoteBackend(socket=path).alive():
            raise Conflict(f"a controller already serves {path}; stop it first")
        path.unlink()  # a stale socket of a daemon that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: access is the file mode
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    return sock


def _tcp_listener(listen: str) -> socket.socket:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidInput(f"--listen {listen!r}: expected HOST:PORT")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    return sock


def serve(
    socket_path: Path | None = None,
    listen: str | None = None,
    audit_path: Path | None = None,
    token: str | None = None,
    prewarm: Sequence[tuple[str, int]] = (),
) -> None:
    """Serve until interrupted. Blocks. prewarm: (tag, K) pools filled in the background at
    start; every pool is drained (waiting QEMUs killed, files removed) when the daemon stops."""
    store = Store.open()
    path = socket_path or default_socket()
    unix = _unix_listener(path)
    backend = LocalBackend(store, Pool(store))
    try:
        for tag, k in prewarm:
            backend.fill_pool(tag, k)
        _serve(backend, unix, listen, audit_path, token)
    finally:
        backend.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _serve(
    backend: LocalBackend,
    unix: socket.socket,
    listen: str | None,
    audit_path: Path | None,
    token: str | None,
) -> None:
    audit = AuditLog(audit_path or backend.store.home / "controller-audit.log")
    metrics = ControllerMetrics()
    servers: list[tuple[uvicorn.Server, socket.socket]] = []
    servers.append((_server(create_app(backend, audit, metrics, None)), unix))
    if listen:
        secret = token or load_or_create_token()
        servers.append(
            (_server(create_app(backend, audit, metrics, secret)), _tcp_listener(listen))
        )
    try:
        asyncio.run(_run(servers))
    finally:
        audit.close()


class _Server(uvicorn.Server):
    """Signals are handled once for all listeners by ``_run``, so cleanup runs on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _server(app: Litestar) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    return _Server(config)


async def _run(servers: list[tuple[uvicorn.Server, socket.socket]]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server, _ in servers:
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in servers))
