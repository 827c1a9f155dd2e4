"""Running the controller daemon: a Unix socket (mode 0600) and, optionally, TCP with a token."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import signal
import socket
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import uvicorn
from litestar import Litestar
from uvicorn.protocols.http.h11_impl import H11Protocol

from forkd.audit import AuditLog
from forkd.controller.api import PoolRequest
from forkd.controller.app import (
    MAX_TOKEN_BYTES,
    ControllerMetrics,
    Token,
    checked_token,
    create_app,
)
from forkd.controller.backend import MAX_SANDBOXES, LocalBackend
from forkd.controller.client import RemoteBackend, default_socket
from forkd.engine.lazy.spare import SpareKeeper
from forkd.engine.paths import run_dir
from forkd.engine.pool import Pool
from forkd.errors import Conflict, InvalidInput
from forkd.private import create_private_file, read_private_file
from forkd.store.store import Store


def token_path() -> Path:
    return run_dir() / "controller.token"


def load_token(token_file: Path | None = None) -> Token:
    """The TCP bearer token, checked (app.checked_token): from ``token_file``, else
    $FORKD_CONTROLLER_TOKEN, else $FORKD_RUN/controller.token, made once when missing. A
    token from a file is read again whenever the file changes (app.Token: replacing it
    revokes the old token without a restart).

    Token files are private files (forkd.private: your own regular file, mode 0600, not a
    symlink). A token file that exists but is empty or short is refused, never replaced:
    forkd writes its file whole, so such a file is not forkd's and may be what a client
    was given."""
    if token_file is not None:
        return _file_token(token_file, "remove it or write a longer token into it")
    env = os.environ.get("FORKD_CONTROLLER_TOKEN")
    if env is not None:
        return Token(checked_token(env, "$FORKD_CONTROLLER_TOKEN"))
    path = token_path()
    made = secrets.token_urlsafe(32)
    create_private_file(path, (made + "\n").encode())
    return _file_token(path, "remove it and forkd serve makes a new one")


def _file_token(path: Path, fix: str) -> Token:
    read = functools.partial(_token_from_file, fix=fix)
    return Token(read(path), path, read)


def _token_from_file(path: Path, fix: str) -> bytes:
    data = read_private_file(path, MAX_TOKEN_BYTES + 2)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = "\x00"  # refused below as not printable ASCII
    try:
        return checked_token(text, str(path))
    except InvalidInput as exc:
        raise InvalidInput(f"{exc}; {fix}") from None


def _unix_listener(path: Path) -> socket.socket:
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise InvalidInput(f"{path} exists and is not a socket; remove it or pick --socket")
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
    token_file: Path | None = None,
    prewarm: Sequence[tuple[str, int]] = (),
    max_sandboxes: int = MAX_SANDBOXES,
) -> None:
    """Serve until interrupted. Blocks. prewarm: (tag, K) pools filled in the background at
    start; every pool is drained (waiting QEMUs killed, files removed) when the daemon stops.
    max_sandboxes: the VMs it runs at once (LocalBackend). With ``listen``, the token
    (load_token) is checked before anything starts."""
    token = load_token(token_file) if listen else None
    store = Store.open()
    path = socket_path or default_socket()
    unix = _unix_listener(path)
    backend = LocalBackend(store, Pool(store), sweeper=True, max_sandboxes=max_sandboxes)
    keeper = SpareKeeper().start()  # a lazy spawn finds a lazy server that has loaded
    try:
        for tag, k in prewarm:
            backend.fill_pool(PoolRequest(tag=tag, k=k))
        _serve(backend, unix, listen, audit_path, token)
    finally:
        keeper.stop()
        backend.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _serve(
    backend: LocalBackend,
    unix: socket.socket,
    listen: str | None,
    audit_path: Path | None,
    token: Token | None,
) -> None:
    audit = AuditLog(audit_path or backend.store.home / "controller-audit.log")
    metrics = ControllerMetrics()
    servers: list[tuple[uvicorn.Server, socket.socket]] = []
    unix_app = create_app(backend, audit, metrics, None)
    servers.append((_server(unix_app, UnixPeerProtocol), unix))
    if listen and token is not None:
        tcp_app = create_app(backend, audit, metrics, token)
        servers.append((_server(tcp_app, "h11"), _tcp_listener(listen)))
    try:
        asyncio.run(_run(servers))
    finally:
        audit.close()


class _Server(uvicorn.Server):
    """Signals are handled once for all listeners by ``_run``, so cleanup runs on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class UnixPeerProtocol(H11Protocol):
    """HTTP on the Unix socket, with the caller's credentials (SO_PEERCRED) as the ASGI
    ``client``: host ``"uid=N pid=N"`` and port = pid, for the audit log (app.peer)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        self.client = (f"uid={uid} pid={pid}", pid)


MAX_HEAD = 16 * 1024  # bytes of a request line and headers (h11's bound; a longer one: 400)
MAX_CONNECTIONS = 256  # open connections and in-flight requests per listener; more: 503


def _server(app: Litestar, http: type[asyncio.Protocol] | Literal["h11"]) -> uvicorn.Server:
    """Both listeners parse with h11, which bounds a request's head (httptools, uvicorn's
    "auto", buffers a URL of any length until its line ends)."""
    config = uvicorn.Config(
        app, http=http, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
        h11_max_incomplete_event_size=MAX_HEAD, limit_concurrency=MAX_CONNECTIONS,
    )
    return _Server(config)


async def _run(servers: list[tuple[uvicorn.Server, socket.socket]]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server, _ in servers:
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in servers))
