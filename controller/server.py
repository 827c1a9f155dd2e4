"""Running the controller daemon: a Unix socket (mode 0600) and, optionally, TCP with a token."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import ipaddress
import os
import secrets
import signal
import socket
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from forkd.audit import AuditLog
from forkd.controller.api import ErrorAnswer, ErrorBody, PoolRequest
from forkd.controller.app import (
    MAX_TOKEN_BYTES,
    ControllerMetrics,
    Token,
    TokenWatch,
    checked_token,
    create_app,
)
from forkd.controller.backend import MAX_SANDBOXES, LocalBackend
from forkd.controller.client import RemoteBackend, default_socket
from forkd.engine.agent_client import KEPT_REPLIES, REQUEST_CLIENT, KeptReplies
from forkd.engine.errors import Busy
from forkd.engine.lazy.spare import SpareKeeper
from forkd.engine.paths import run_dir
from forkd.engine.pool import Pool
from forkd.errors import Conflict, InvalidInput
from forkd.private import create_private_file, read_private_file
from forkd.store.store import Store


def token_path() -> Path:
    return run_dir() / "controller.token"


TOKEN_ENV = "FORKD_CONTROLLER_TOKEN"


def taken_env_token() -> str | None:
    """$FORKD_CONTROLLER_TOKEN, taken out of this process's environment (the daemon's,
    `forkd mcp`'s): what they start with the whole environment (the spare lazy page server
    started with the daemon, a lazy spawn's, the watchdog) inherited the token that
    controls every sandbox of the daemon, readable in its /proc/PID/environ and handed to
    whatever those processes run."""
    return os.environ.pop(TOKEN_ENV, None)


def load_token(token_file: Path | None = None) -> Token:
    """The TCP bearer token, checked (app.checked_token): from ``token_file``, else
    $FORKD_CONTROLLER_TOKEN, else $FORKD_RUN/controller.token, made once when missing. A
    token from a file is read again whenever the file changes (app.Token: replacing it
    revokes the old token without a restart).

    Token files are private files (forkd.private: your own regular file, mode 0600, not a
    symlink). A token file that exists but is empty or short is refused, never replaced:
    forkd writes its file whole, so such a file is not forkd's and may be what a client
    was given. $FORKD_CONTROLLER_TOKEN is taken out of the environment (taken_env_token),
    whichever token is used."""
    env = taken_env_token()
    if token_file is not None:
        return _file_token(token_file, "remove it or write a longer token into it")
    if env is not None:
        return Token(checked_token(env, f"${TOKEN_ENV}"))
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
    # Listening from the moment the path exists: a client that sees the socket while the
    # daemon still starts (its backend, its pools) waits in the backlog until it serves,
    # instead of being refused (uvicorn's create_server listens again, which is harmless).
    sock.listen(MAX_CONNECTIONS)
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
    max_per_client: int | None = None,
) -> None:
    """Serve until interrupted. Blocks. prewarm: (tag, K) pools filled in the background at
    start; every pool is drained (waiting QEMUs killed, files removed) when the daemon stops.
    max_sandboxes: the VMs it runs at once, max_per_client: those one client may have started
    (LocalBackend; None: half of max_sandboxes). With ``listen``, the token
    (load_token) is checked before anything starts."""
    token = load_token(token_file) if listen else None
    taken_env_token()  # without --listen it serves nothing, and is passed on to nothing
    store = Store.open()
    path = socket_path or default_socket()
    unix = _unix_listener(path)
    backend = LocalBackend(store, Pool(store), sweeper=True, max_sandboxes=max_sandboxes,
                           max_per_client=max_per_client)
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
        tcp_app = TokenWatch(create_app(backend, audit, metrics, token), token)
        servers.append((_server(tcp_app, BoundedProtocol), _tcp_listener(listen)))
    try:
        asyncio.run(_run(servers))
    finally:
        audit.close()


class _Server(uvicorn.Server):
    """Signals are handled once for all listeners by ``_run``, so cleanup runs on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


MAX_HEAD = 16 * 1024  # bytes of a request line and headers (h11's bound; a longer one: 400)
MAX_CONNECTIONS = 256  # open connections, and requests in flight, per listener; more: 503
# of them one client may hold (a uid on the Unix socket, an address on TCP): the others
# always keep the rest
MAX_PER_PEER = MAX_CONNECTIONS // 2
HEAD_TIMEOUT_S = 10.0  # a request head must arrive whole within this (docs/api.md)
STALL_TIMEOUT_S = 60.0  # an answer the client does not read for this long: closed
LINGER_S = 1.0  # a refused connection is read (and dropped) this long, then closed


@dataclass(frozen=True)
class Limits:
    """What one connection may hold of a listener (docs/api.md, "Connections")."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    stall_timeout_s: float = STALL_TIMEOUT_S
    max_per_peer: int = MAX_PER_PEER


DEFAULT_LIMITS = Limits()


class BoundedConfig(uvicorn.Config):
    """A uvicorn Config that carries the Limits its BoundedProtocol connections keep."""

    def __init__(self, app: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits
        self.peers: collections.Counter[str] = collections.Counter()  # slots each client holds


def _raw_answer(status: int, reason: str, message: str, kind: type[Exception] = Busy) -> bytes:
    """A whole HTTP/1.1 answer with the controller's error body (api.ErrorAnswer), for a
    connection that gets no request cycle (refused, its head never came, or ambiguous)."""
    body = msgspec.json.encode(ErrorAnswer(error=ErrorBody(
        type=kind.__name__, message=message, exit_code=getattr(kind, "exit_code", 1))))
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body


def framing_problem(head: bytes) -> str | None:
    """What makes a request head ambiguous to the readers between a client and forkd (a
    TLS proxy in front reads it too), else None. h11 takes both, its own way, where a proxy
    may take the other: Content-Length with Transfer-Encoding (h11 goes by the chunks, a
    proxy by the length: the rest is read as a second request, smuggled), and a header
    line folded onto the one before (obs-fold, which RFC 9112 5.2 has a server refuse:
    h11 appends it to the previous header's value, a proxy may read it as a header)."""
    lines = head.split(b"\n")[1:]  # after the request line
    names = set()
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            return ("a header line continues the one before it (obsolete line folding); "
                    "send each header on one line")
        names.add(line.partition(b":")[0].strip().lower())
    if b"content-length" in names and b"transfer-encoding" in names:
        return ("the request has both Content-Length and Transfer-Encoding, whose readers "
                "may split it differently; send one of them")
    return None


class BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a bound on everything a client can hold by being slow:

    - a request head must arrive whole within ``head_timeout_s`` of the connection's start,
      and again of the end of each answer: a client that sends its head byte by byte, idles
      on a kept-alive connection, or drips the rest of a body the answer did not read (a
      401's) is closed then (the deadline is fixed: bytes arriving do not extend it);
    - a request body the app waits for must keep coming: at least MIN_BODY_BYTES in every
      ``head_timeout_s``, else the connection is closed;
    - an answer the client does not read (writing paused) for ``stall_timeout_s`` ends the
      connection (the relay then ends the stream and its command, app.relayed);
    - past ``max_connections`` open connections, or requests in flight, a new connection
      gets a 503 saying so and is closed; it is not counted while it lingers;
    - one client (peer_of: a uid on the Unix socket, an address on TCP) holds at most
      ``max_per_peer`` of them: a connection counts from its start until it is closed and
      its request has ended, so a client cannot take every slot, by connections or by
      requests it left running.
    Applied to every listener by bounded_config."""

    MIN_BODY_BYTES = 16 * 1024

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.limits = config.limits if isinstance(config, BoundedConfig) else Limits()
        self.limit_concurrency = None  # decided here (one message), not by uvicorn
        self.app = self._admitted(self.app)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._seen_cycle: object = None
        self._received = 0  # bytes since the body window started
        self._refused = False
        self._peers = config.peers if isinstance(config, BoundedConfig) else None
        self._peer: str | None = None  # the client whose slot this connection holds
        self._running = 0  # its requests the app has not finished
        self._lost = False

    def _admitted(self, app: Any) -> Any:
        async def admitted(scope: Any, receive: Any, send: Any) -> None:
            if len(self.tasks) > self.limits.max_connections:  # this request's task counts
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"retry-after", b"1"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": self._busy_body()})
                return
            self._running += 1
            # the request's guest work counts against its client's shares of the guest
            # requests and the reply budget (agent_client.REQUEST_CLIENT), the client
            # being who the connection says, as for its slots
            client = REQUEST_CLIENT.set(self._peer or peer_of(self.transport))
            # the guest replies it was answered from stay counted (agent_client
            # KEPT_REPLIES) until its answer has been sent, however slowly it is read
            kept = KeptReplies()
            replies = KEPT_REPLIES.set(kept)
            try:
                await app(scope, receive, send)
                # an answer's last part waits in the transport for a slow reader (uvicorn
                # waits for room before a write, not after): its reply is held till then
                if self.flow.write_paused and not self.transport.is_closing():
                    await self.flow.drain()  # at most stall_timeout_s (then aborted)
            finally:
                KEPT_REPLIES.reset(replies)
                REQUEST_CLIENT.reset(client)
                kept.release()
                self._running -= 1
                if self._lost and not self._running:
                    self._release_peer()

        return admitted

    def _busy_message(self) -> str:
        return (f"the server is at its limit of {self.limits.max_connections} open connections "
                "and requests in flight; retry in a moment, or close connections you do not "
                "use (docs/api.md, Connections)")

    def _busy_body(self) -> bytes:
        return msgspec.json.encode(ErrorAnswer(error=ErrorBody(
            type="Busy", message=self._busy_message(), exit_code=Busy.exit_code)))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if (len(self.connections) > self.limits.max_connections
                or len(self.tasks) >= self.limits.max_connections):
            self._refuse(transport, self._busy_message())
            return
        if self._peers is not None:
            peer = peer_of(transport)
            if self._peers[peer] >= self.limits.max_per_peer:
                self._refuse(transport, (
                    f"this client ({peer}) holds {self._peers[peer]} connections or requests "
                    f"of this server, the most one client may ({self.limits.max_per_peer} of "
                    f"{self.limits.max_connections}); close connections you do not use, or "
                    "retry when your requests have ended (docs/api.md, Connections)"))
                return
            self._peers[peer] += 1
            self._peer = peer
        self._arm(self._head_late, self.limits.head_timeout_s)

    def _release_peer(self) -> None:
        if self._peer is not None and self._peers is not None:
            self._peers[self._peer] -= 1
            if self._peers[self._peer] <= 0:
                del self._peers[self._peer]
            self._peer = None

    def _refuse(self, transport: asyncio.Transport, message: str) -> None:
        self._refused = True
        self.connections.discard(self)
        transport.write(_raw_answer(503, "Service Unavailable", message))
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then EOF; its request is read and dropped
        self._deadline = self.loop.call_later(LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and not self._ambiguous():
            return
        super().handle_events()
        if self.transport.is_closing() or self.cycle is None or self.cycle is self._seen_cycle:
            return
        self._seen_cycle = self.cycle  # a new request's head arrived whole
        self._cancel_deadline()
        if self.conn.their_state is h11.SEND_BODY:
            self._received = 0
            self._arm(self._body_slow, self.limits.head_timeout_s)

    def _ambiguous(self) -> bool:
        """Whether the next request head, once whole, may be read (framing_problem: an
        ambiguous one gets a 400 and the connection is closed, nothing of it reaches the
        app or is read as a next request). True: go on reading it."""
        if self.transport.is_closing():
            return False
        data = self.conn.trailing_data[0]
        end = data.find(b"\r\n\r\n")
        if end < 0:
            end = data.find(b"\n\n")
        if end < 0:
            return True  # not whole yet (h11 bounds its size)
        problem = framing_problem(bytes(data[:end]).replace(b"\r\n", b"\n"))
        if problem is None:
            return True
        self.transport.write(_raw_answer(400, "Bad Request", problem, InvalidInput))
        self._cancel_deadline()
        self.transport.close()
        return False

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # armed first: a pipelined head disarms it
            self._arm(self._head_late, self.limits.head_timeout_s)
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.stall_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.resume_writing()  # cancels the stall timer
        if self._refused:
            return
        self._lost = True
        if not self._running:
            self._release_peer()
        super().connection_lost(exc)

    def _arm(self, callback: Callable[[], None], seconds: float) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, callback)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_raw_answer(408, "Request Timeout", (
                f"the request head did not arrive whole within {self.limits.head_timeout_s:g} "
                "s; send the request line and headers at once")))
        self.transport.close()

    def _body_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is not h11.SEND_BODY or self.cycle is not self._seen_cycle:
            return
        if self._received < self.MIN_BODY_BYTES and not self.flow.read_paused:
            # (while reading is paused the app is not taking the body: the pace is ours)
            self.transport.abort()  # the app waiting for the body sees the client gone
            return
        self._received = 0
        self._arm(self._body_slow, self.limits.head_timeout_s)


def peer_of(transport: asyncio.BaseTransport) -> str:
    """Who a connection's client is, for the per-client bound: ``uid=N`` on a Unix socket
    (SO_PEERCRED: a process cannot pick another's uid), the address on TCP (any port; an
    IPv6 address's /64, peer_address)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return f"uid={struct.unpack('3i', creds)[1]}"
    peername = transport.get_extra_info("peername")
    return peer_address(str(peername[0])) if isinstance(peername, tuple) and peername else "-"


def peer_address(host: str) -> str:
    """The client a TCP address counts as: an IPv4 address (also written as IPv4-mapped
    IPv6), or an IPv6 address's /64, which one subscriber is given whole (counted by
    address, one host could take every slot from addresses of its own prefix)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class UnixPeerProtocol(BoundedProtocol):
    """HTTP on the Unix socket, with the caller's credentials (SO_PEERCRED) as the ASGI
    ``client``: host ``"uid=N pid=N"`` and port = pid, for the audit log (app.peer)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self._refused or sock is None or sock.family != socket.AF_UNIX:
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        self.client = (f"uid={uid} pid={pid}", pid)


def bounded_config(
    app: Any,
    protocol: type[BoundedProtocol] = BoundedProtocol,
    limits: Limits = DEFAULT_LIMITS,
    **kwargs: Any,
) -> BoundedConfig:
    """The uvicorn Config of every forkd listener (the daemon's Unix socket and TCP, `forkd
    mcp`'s HTTP): h11 with a bounded head (httptools, uvicorn's "auto", buffers a URL of
    any length until its line ends), BoundedProtocol's deadlines and connection cap, and
    no WebSocket upgrade (an upgraded connection would leave the protocol's bounds), and
    the caller is who the connection says (its address, its SO_PEERCRED), never what
    its headers claim: uvicorn otherwise takes X-Forwarded-For and X-Forwarded-Proto from
    any client on 127.0.0.1 (or from anyone, with $FORWARDED_ALLOW_IPS=*), so a local
    user could write any address into the audit log's records of its requests."""
    return BoundedConfig(
        app, limits, http=protocol, ws="none", log_level="warning",
        h11_max_incomplete_event_size=MAX_HEAD, proxy_headers=False, **kwargs,
    )


def _server(app: Any, protocol: type[BoundedProtocol]) -> uvicorn.Server:
    return _Server(bounded_config(app, protocol, lifespan="on", timeout_graceful_shutdown=5))


async def _run(servers: list[tuple[uvicorn.Server, socket.socket]]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server, _ in servers:
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in servers))
