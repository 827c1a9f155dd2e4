"""The controller's REST API (Litestar): snapshots and sandboxes of this host, v1.

Served on a Unix socket (access by file mode) and optionally on TCP, where
every route but ``/healthz`` needs ``Authorization: Bearer <token>``. Errors
are ``{"error": {"type", "message", "exit_code"}}`` with an HTTP status from
the error family. Every write and every refused token goes to the audit log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
from litestar import Litestar, Request, Response, Router, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.exceptions import ClientException, NotAuthorizedException, ValidationException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter, RawBody
from litestar.response import Stream
from litestar.types import ASGIApp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

import forkd
from forkd.audit import MAX_TARGET, AuditLog, BoundedAudit
from forkd.bodies import explained, held_size
from forkd.controller import api
from forkd.controller.api import (
    BranchRequest,
    BranchResult,
    CompactRequest,
    ErrorAnswer,
    ErrorBody,
    EvalRequest,
    EvalResult,
    ExecFrame,
    ExecRequest,
    ExecResult,
    ExtendRequest,
    Health,
    LayerInfo,
    PoolRemoved,
    PoolRequest,
    PoolStatus,
    ProcessInfo,
    ProcessKillRequest,
    ProcessSignaled,
    ProcessStartRequest,
    ProcessStdinRequest,
    ProcessWaitRequest,
    ProcessWaitResult,
    Removed,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SpawnRequest,
    SpawnResult,
    StdinWritten,
)
from forkd.controller.backend import (
    CALLER_STOP,
    PENDING,
    ByteBudget,
    LocalBackend,
    PoolBackend,
    Stop,
    Stopped,
    Transfer,
    Waiting,
)
from forkd.engine.agent_client import REQUEST_CLIENT
from forkd.engine.commands import MAX_PUT_BYTES
from forkd.engine.errors import Busy, TooManyRequests
from forkd.engine.paths import hidden_host_paths
from forkd.errors import (
    ChainError,
    Conflict,
    ForkdError,
    IntegrityError,
    InvalidInput,
    NotFound,
)
from forkd.jsondoc import check_body
from forkd.names import inert, shortened, shown
from forkd.shares import Shares

STATUS: list[tuple[type[ForkdError], int]] = [
    (TooManyRequests, 429),  # before Conflict, which it is too
    (InvalidInput, 400),
    (NotFound, 404),
    (Conflict, 409),
    (IntegrityError, 422),
    (ChainError, 422),
]
MAX_FILE_BYTES = MAX_PUT_BYTES  # PUT .../files: what one request carries into a guest
MAX_JSON_BYTES = 10_000_000  # any other request body (Litestar's default, made explicit)
MIN_TOKEN_BYTES = 32  # a bearer token shorter than this is refused at start
MAX_TOKEN_BYTES = 4096  # and one longer (it must fit in a request header)
MAX_MESSAGE_CHARS = 16_000  # an error message answered (guest text in it is cut before)
OPENAPI = OpenAPIConfig(title="forkd controller", version="1", path="/schema")


@dataclass
class ControllerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = Counter(
            "forkd_controller_requests",
            "API requests",
            ["method", "status"],
            registry=self.registry,
        )
        self.spawned = Counter(
            "forkd_controller_sandboxes_spawned", "sandboxes started", registry=self.registry
        )
        self.spawn_seconds = Histogram(
            "forkd_controller_spawn_seconds",
            "time to get N sandboxes ready",
            registry=self.registry,
        )
        self.running = Gauge(
            "forkd_controller_sandboxes_running", "sandboxes running", registry=self.registry
        )


GONE = (0, 0, 0, 0, 0, 0)  # a token file's stamp while it is gone (st_ino is never 0)


class Token:
    """The TCP bearer token: a fixed one ($FORKD_CONTROLLER_TOKEN), or a token file's, read
    again whenever the file changes, so replacing the file revokes the old token at once
    (no restart). A token file that is gone, or no longer holds a valid token, refuses
    every request until it is fixed: a revocation never falls back to the old token."""

    def __init__(self, value: bytes, path: Path | None = None,
                 read: Callable[[Path], bytes] | None = None) -> None:
        """value: the checked token (checked_token); path and read: its file and how to read
        and check it again (server._token_from_file)."""
        if len(value) < MIN_TOKEN_BYTES:
            raise InvalidInput(f"a bearer token must be at least {MIN_TOKEN_BYTES} bytes")
        self._value = value
        self._path = path
        self._read = read
        self._seen = self._stamp()
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[int, ...] | None:
        """What tells a changed file. Its mode and owner too: a chmod or chown changes only
        the ctime, whose clock ticks coarsely (a jiffy), so a file made readable by others
        within the tick of its last change kept its stamp and its token went on working."""
        if self._path is None:
            return None
        try:
            st = os.lstat(self._path)
        except OSError:
            return GONE
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid)

    def current(self) -> bytes:
        """The token a request must carry now; b"" (which nothing matches) while the file
        is gone or invalid."""
        if self._path is None or self._read is None:
            return self._value
        stamp = self._stamp()
        with self._lock:
            if stamp != self._seen:
                self._seen = stamp
                try:
                    self._value = self._read(self._path) if stamp != GONE else b""
                except (InvalidInput, OSError):
                    self._value = b""
            return self._value


REFUSED_PER_MINUTE = 120
# failed requests (nothing changed) are audited at most this many a minute: a caller with
# the token, or on the socket, provokes one at will (an exec in a sandbox that is not
# there), each a record of up to a KiB; past the budget they are counted
FAILED_PER_MINUTE = 120


@dataclass
class Controller:
    """One listener's view of the daemon: the Unix socket (token None) or TCP (token set)."""

    backend: PoolBackend
    audit: AuditLog
    metrics: ControllerMetrics
    token: Token | None  # required on this listener when set
    # refused requests (a wrong token) are audited at most this many a minute, each path
    # shortened: anyone who reaches the port can send them
    refused: BoundedAudit = field(init=False)
    failed: BoundedAudit = field(init=False)

    def __post_init__(self) -> None:
        # one client (agent_client.REQUEST_CLIENT: an address on TCP, a uid on the socket)
        # has half of each budget: its flood leaves the others' records written
        self.refused = BoundedAudit(self.audit, REFUSED_PER_MINUTE, "auth.suppressed",
                                    share=REFUSED_PER_MINUTE // 2)
        self.failed = BoundedAudit(self.audit, FAILED_PER_MINUTE, "failed.suppressed",
                                   share=FAILED_PER_MINUTE // 2)

    @property
    def transport(self) -> str:
        return "unix-socket" if self.token is None else "tcp"


Ctl = NamedDependency[Controller]
ERRORS = {
    status: ResponseSpec(ErrorAnswer, description=what, generate_examples=False)
    for status, what in [
        (400, "InvalidInput: the request is malformed or out of range"),
        (401, "missing or wrong bearer token (TCP only)"),
        (404, "NotFound: no such sandbox, snapshot, pool or file"),
        (409, "Conflict: the tag exists, is depended on, or the sandbox is in another state"),
        (422, "IntegrityError or ChainError: the store's data is damaged"),
        (429, "TooManyRequests: this client holds its share of the guest requests (retry "
              "once one of its requests has ended) or of the VMs (kill or pause some)"),
        (500, "any other error, with its forkd exit code"),
    ]
}
STREAM = ResponseSpec(
    ExecFrame,
    media_type="application/x-ndjson",
    description="one api.ExecFrame per line: output as it comes, {} heartbeats, then result",
    generate_examples=False,
)
Req = Request[Any, Any, Any]
T = TypeVar("T")


# request and answer types: forkd.controller.api


# -- auth and audit -----------------------------------------------------------
def checked_token(token: str, source: str) -> bytes:
    """The TCP bearer token as bytes; InvalidInput when it is short enough to guess (under
    MIN_TOKEN_BYTES, an empty one included) or cannot travel in a header."""
    text = token.strip()
    if not all("!" <= c <= "~" for c in text):
        raise InvalidInput(
            f"{source}: the bearer token has characters other than printable ASCII; "
            "use letters, digits and punctuation only"
        )
    raw = text.encode("ascii")
    if not MIN_TOKEN_BYTES <= len(raw) <= MAX_TOKEN_BYTES:
        raise InvalidInput(
            f"{source}: the bearer token is {len(raw)} bytes; it must be {MIN_TOKEN_BYTES} to "
            f"{MAX_TOKEN_BYTES} (make one with: python3 -c "
            "'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return raw


def presented_token(connection: ASGIConnection[Any, Any, Any, Any]) -> bytes:
    """The token of ``Authorization: Bearer <token>``, or b"" when there is none, or more
    than one Authorization header (scope_token: the guard and TokenWatch read the header
    one way, so no request passes one and escapes the other)."""
    return scope_token(connection.scope)


def token_matches(presented: bytes, expected: bytes) -> bool:
    """Constant-time comparison; an empty token never matches, whatever was configured."""
    return bool(presented) and bool(expected) and hmac.compare_digest(presented, expected)


TOKEN_RECHECK_S = 1.0  # how often a request in flight on TCP checks its token still holds


def scope_token(scope: Any) -> bytes:
    """The token of a request's one ``Authorization: Bearer`` header; b"" when there is
    none, another scheme, or more than one Authorization header (which one would count
    is a parser's choice: the guard took the first, TokenWatch none, so a valid token
    followed by another header was let in and never rechecked)."""
    given = [v for k, v in scope.get("headers", []) if k == b"authorization"]
    if len(given) != 1:
        return b""
    scheme, _, credential = bytes(given[0]).partition(b" ")
    return credential.strip() if scheme.lower() == b"bearer" else b""


class TokenWatch:
    """ASGI middleware of the token listeners (the daemon's TCP, `forkd mcp`'s HTTP): a
    request that carried the valid token is ended once the token stops matching (its file
    replaced or removed, app.Token), checked every ``every`` seconds while it runs. A long
    exec stream, file transfer or MCP event stream thus ends at a revocation instead of
    going on for as long as its client reads: an answer not yet started is a 401 saying so,
    a started one is cut (the connection closes before the answer is complete). Requests
    without the token pass through to the app, whose guard answers them."""

    def __init__(self, app: Any, token: Token, every: float = TOKEN_RECHECK_S) -> None:
        self.app = app
        self.token = token
        self.every = every

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        presented = scope_token(scope)
        if scope.get("type") != "http" or not token_matches(presented, self.token.current()):
            await self.app(scope, receive, send)
            return
        stop = Stop()  # the request's work in a guest is stopped at a revocation too
        reset = CALLER_STOP.set(stop)
        try:
            await self._watched(scope, receive, send, presented, stop)
        finally:
            CALLER_STOP.reset(reset)

    async def _watched(self, scope: dict[str, Any], receive: Any, send: Any,
                       presented: bytes, stop: Stop) -> None:
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        revoked = False
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                nonlocal revoked
                while token_matches(presented, self.token.current()):
                    await anyio.sleep(self.every)
                revoked = True
                stop.set("revoked")  # a handler waiting on a guest (exec) gives up first
                group.cancel_scope.cancel()

            group.start_soon(watch)
            await self.app(scope, receive, tracked)
            group.cancel_scope.cancel()
        if revoked and not started:
            body = ErrorBody(type="Unauthorized", exit_code=8, message=(
                "the bearer token was revoked while this request ran; send the new token"))
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer realm="forkd"')]})
            await send({"type": "http.response.body",
                        "body": msgspec.json.encode(ErrorAnswer(error=body))})


class CallerWatch:
    """ASGI middleware of every daemon listener: a request's Stop (backend.CALLER_STOP,
    seen by the worker thread that serves it) is set once its client goes away, so a
    request that waits on a guest (exec, eval, run_code, a process's wait) is given up
    and its command killed, instead of running for a client that will never read the
    answer (and holding a thread and one of the daemon's guest requests meanwhile). The
    client's leaving is learnt from ``http.disconnect``, awaited once the app has had
    the whole body. TokenWatch, outside it on TCP, sets the same Stop at a revocation."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        stop = CALLER_STOP.get()
        if stop is None:  # TokenWatch made none (the Unix socket)
            stop = Stop()
        reset = CALLER_STOP.set(stop)
        try:
            async with anyio.create_task_group() as group:
                watching = False

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    stop.set("gone")

                async def received() -> Any:
                    nonlocal watching
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        stop.set("gone")
                    elif not message.get("more_body") and not watching:
                        watching = True  # the body is whole: what comes next is the end
                        group.start_soon(watch)
                    return message

                await self.app(scope, received, send)
                group.cancel_scope.cancel()
        finally:
            CALLER_STOP.reset(reset)


BODY_BYTES = 512 << 20  # request bodies the daemon holds at once, all clients' together


class BodyBudget(Shares):
    """Bytes of request bodies being held (a file's up to 32 MiB, a JSON body's up to 10 MB,
    read whole before the handler runs and kept until it ends), in all and per client (as
    agent_client.REQUEST_CLIENT names it: half of ``total``): without it one client with
    128 connections held 4 GiB of uploads in the daemon's memory at once."""

    def take(self, n: int, client: str | None) -> ForkdError | None:
        """Count ``n`` more bytes for ``client``; else the error saying which bound."""
        refused = self.take_or_refuse(n, client)
        if refused is None:
            return None
        if refused.bound == "client":
            return TooManyRequests(
                f"this client ({client}) has {refused.held} bytes of request bodies being "
                f"received or served, and this one is {n}: one client holds at most "
                f"{self.share} (app.BODY_BYTES, half); wait for its uploads to end, "
                "or send fewer at once")
        return Busy(
            f"the daemon holds as many bytes of request bodies as it takes at once "
            f"({self.total}, app.BODY_BYTES) and this one is {n}; try again shortly")


BODY_BUDGET = BodyBudget(BODY_BYTES)


def _body_size(scope: Any) -> int:
    """What a request's body may hold in the daemon: its Content-Length, else (chunked) the
    most its route takes; never more than that."""
    return held_size(scope, MAX_FILE_BYTES if scope.get("method") == "PUT" else MAX_JSON_BYTES)


class Budget(Protocol):
    """A Shares whose ``take`` says, as a ForkdError, which bound a request would pass."""

    def take(self, n: int, client: str | None) -> ForkdError | None: ...

    def give(self, n: int, client: str | None = None) -> None: ...


def counted(app: ASGIApp, budget: Callable[[], Budget],
            size: Callable[[Any], int]) -> ASGIApp:
    """``app`` with each HTTP request counted against ``budget()`` (``size(scope)`` of it;
    0: not counted) from its start until its answer is sent, for its client
    (REQUEST_CLIENT); one that would pass it is answered at once, its body not read: 429
    (TooManyRequests, Retry-After) past its client's share, 409 (Busy) past the bound."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        n = size(scope) if scope.get("type") == "http" else 0
        if n == 0:
            await app(scope, receive, send)
            return
        client, shares = REQUEST_CLIENT.get(), budget()
        refused = shares.take(n, client)
        if refused is not None:
            await refuse_at_once(send, refused)
            return
        try:
            await app(scope, receive, send)
        finally:
            shares.give(n, client)

    return middleware


def body_budget(app: ASGIApp) -> ASGIApp:
    """A Litestar middleware (every route): a request's body counts against BODY_BUDGET."""
    return counted(app, lambda: BODY_BUDGET, _body_size)


# the threads the daemon's blocking handlers run in (anyio's default limiter, 40 unless
# set: ``set_workers`` at start-up), and so the requests in flight at once: one client (as
# REQUEST_CLIENT names it) at most half; without it one client's slow requests (compacts,
# spawns, pool fills that wait, file transfers) took every worker and every other
# client's kill or list waited behind them
WORKERS = 64


class RequestShares(Shares):
    """Requests in flight, counted from their start until their answer is sent."""

    def take(self, n: int, client: str | None) -> ForkdError | None:
        refused = self.take_or_refuse(n, client)
        if refused is None:
            return None
        if refused.bound == "client":
            return TooManyRequests(
                f"this client ({client}) has {refused.held} requests in flight: one client "
                f"has at most {self.share} at once (half of the daemon's {self.total} "
                "workers, app.WORKERS); wait for one of them to end")
        return Busy(f"the daemon serves {self.total} requests at once (app.WORKERS) and "
                    "all of them are in flight; try again shortly")


REQUESTS = RequestShares(WORKERS)


def set_workers() -> None:
    """Give the daemon's blocking handlers WORKERS threads (at its start, in its loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = WORKERS


def request_share(app: ASGIApp) -> ASGIApp:
    """A Litestar middleware (every route): each request counts one against REQUESTS."""
    return counted(app, lambda: REQUESTS, lambda scope: 1)


async def refuse_at_once(send: Any, refused: ForkdError) -> None:
    """Answer ``refused`` before the request's body is read, closing the connection."""
    status, body = error_answer(refused)
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    if status == 429:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body",
                "body": msgspec.json.encode(ErrorAnswer(error=body))})


def caller_watch(app: ASGIApp) -> ASGIApp:
    """CallerWatch as a Litestar middleware (every route of the app)."""
    watched: ASGIApp = CallerWatch(app)
    return watched


def peer(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The caller for the audit log: ``HOST:PORT`` on TCP, ``uid=N pid=N`` on the socket
    (from SO_PEERCRED, see server.UnixPeerProtocol), ``-`` when unknown."""
    client = connection.client
    if client is None:
        return "-"
    if connection.app.state.controller.token is None:
        return client.host  # UnixPeerProtocol puts the whole "uid=N pid=N" there
    host = f"[{client.host}]" if ":" in client.host else client.host
    return f"{host}:{client.port}"


def require_token(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    ctl: Controller = connection.app.state.controller
    if ctl.token is None or is_public(handler):
        return
    if not token_matches(presented_token(connection), ctl.token.current()):
        ctl.refused.record("-", peer(connection), "auth", connection.url.path, "denied",
                           client=REQUEST_CLIENT.get())
        many = sum(1 for k, _ in connection.scope["headers"] if k == b"authorization") > 1
        raise NotAuthorizedException(
            "more than one Authorization header: send one, Authorization: Bearer <token>"
            if many else "missing or wrong bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="forkd"'},
        )


def audited(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    action: str,
    target: str,
    result: str,
    **detail: Any,
) -> None:
    """One audit record of a request, every value a caller chose in it bounded (audit_value:
    an argv of 8 arguments of 128 KiB, a 16 KiB path, a guest's long error each made a
    record of a MiB, as often as the caller liked)."""
    ctl.audit.record(ctl.transport, peer(request), action, audit_value(target, MAX_TARGET),
                     result, **{k: audit_value(v) for k, v in detail.items()})


AUDIT_CHARS = 1000  # characters of a caller-chosen text kept in an audit record
AUDIT_ITEMS = 16  # items of a caller-chosen list kept in an audit record


def audit_value(value: Any, chars: int = AUDIT_CHARS) -> Any:
    """``value`` for an audit record: each text cut to ``chars`` (saying how much was cut),
    each list to AUDIT_ITEMS items (saying how many were left out), in depth."""
    if isinstance(value, str):
        return shortened(value, chars)
    if isinstance(value, (list, tuple)):
        kept = [audit_value(v, chars) for v in value[:AUDIT_ITEMS]]
        if len(value) > AUDIT_ITEMS:
            kept.append(f"…({len(value) - AUDIT_ITEMS} more)")
        return kept
    if isinstance(value, dict):
        return {str(k)[:chars]: audit_value(v, chars) for k, v in value.items()}
    return value


def error_answer(exc: Exception, home: Path | None = None) -> tuple[int, ErrorBody]:
    """The HTTP status and error body of an exception (the error family's), however it
    is sent (an error answer, a stream's error frame). A request that does not match its
    declared type (api.py) is InvalidInput, saying what is wrong. The message names this
    host's forkd directories by their variables (hidden_host_paths; ``home``: the store's)
    and is inert (names.inert): what a guest wrote into it (an agent's refusal, a console
    tail) reaches a client's terminal as visible text, never as its commands."""
    status, body = _answer_of(exc)
    body.message = inert(hidden_host_paths(body.message, home), MAX_MESSAGE_CHARS)
    return status, body


def store_home(ctl: Controller) -> Path | None:
    """The home of the store the daemon serves (hidden in its errors), if it has one."""
    return ctl.backend.store.home if isinstance(ctl.backend, LocalBackend) else None


def _answer_of(exc: Exception) -> tuple[int, ErrorBody]:
    if isinstance(exc, ValidationException):
        exc = InvalidInput(f"{explained(exc)} (docs/api.md)")
    if isinstance(exc, RequestEntityTooLarge):
        return 413, ErrorBody(type="InvalidInput", exit_code=InvalidInput.exit_code, message=(
            f"the request body is too large: a JSON body takes at most {MAX_JSON_BYTES} "
            f"bytes, a file (PUT .../files) at most {MAX_FILE_BYTES}; send larger input as "
            "files, in parts"))
    if isinstance(exc, ClientException) and exc.status_code == 400:  # e.g. malformed JSON
        exc = InvalidInput(f"{exc.detail}; the request must be JSON as docs/api.md declares")
    if not isinstance(exc, ForkdError):
        status = getattr(exc, "status_code", 500)
        message = getattr(exc, "detail", str(exc)) if status < 500 else "internal error"
        return status, ErrorBody(type="HTTPError", message=str(message), exit_code=1)
    family = next(((cls, code) for cls, code in STATUS if isinstance(exc, cls)), None)
    kind = family[0].__name__ if family else type(exc).__name__
    return (family[1] if family else 500), ErrorBody(
        type=kind, message=str(exc), exit_code=exc.exit_code
    )


def error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    ctl: Controller = request.app.state.controller
    if isinstance(exc, NotAuthorizedException):
        body = ErrorBody(type="Unauthorized", message=str(exc.detail), exit_code=8)
        return Response(ErrorAnswer(error=body), status_code=401, headers=exc.headers)
    if isinstance(exc, Stopped) and exc.reason == "revoked":
        body = ErrorBody(type="Unauthorized", message=str(exc), exit_code=8)
        return Response(ErrorAnswer(error=body), status_code=401,
                        headers={"WWW-Authenticate": 'Bearer realm="forkd"'})
    status, body = error_answer(exc, store_home(ctl))
    # a client past its share (429) may retry once one of its requests has ended
    retry = {"Retry-After": "1"} if status == 429 else None
    if isinstance(exc, ForkdError) and request.method != "GET":
        ctl.failed.record(ctl.transport, peer(request), request.method, request.url.path,
                          "failed", client=REQUEST_CLIENT.get(), error=audit_value(str(exc)))
    return Response(ErrorAnswer(error=body), status_code=status, headers=retry)


async def check_request(request: Request[Any, Any, Any]) -> None:
    """What a request says is read one way only, before the handler runs (after the token
    guard): its query (check_query), and a JSON body nested deeper than jsondoc.MAX_DEPTH,
    or naming a key twice in one object, is an InvalidInput (400) before it is parsed
    (jsondoc.check_body): the parser recurses once per level, and thousands of ``[`` would
    end in a RecursionError (a 500); and msgspec keeps the last of a repeated key where
    the audit log or a proxy may read the first. A body's value is of its declared type
    (strict_body), as a query's number or flag is written one way (check_query)."""
    check_query(request)
    data = request.route_handler.parsed_fn_signature.parameters.get("data")
    if data is not None:
        body = await request.body()
        check_body(body)
        strict_body(body, data.annotation)


def strict_body(body: bytes, declared: Any) -> None:
    """InvalidInput (400) when a JSON body's value is not of the type docs/api.md and the
    OpenAPI document declare: Litestar converts leniently, so ``"n": "2"``, ``"n": 2.0``
    and ``"timeout": "1e9"`` were numbers to the daemon, while a proxy or policy in front
    that checks the numbers of a request (as the schema says they are) let the strings
    by. A number for a float field is a float, as JSON has it. A body wrong in any other
    way (a field missing, a value out of range) is left to Litestar's parse, which says
    so as before."""
    try:
        msgspec.json.decode(body, type=declared)
    except msgspec.ValidationError as exc:
        try:
            msgspec.json.decode(body, type=declared, strict=False)
        except msgspec.DecodeError:
            return  # wrong however read
        raise InvalidInput(f"invalid request: {shortened(str(exc), 300)}; send each field "
                           "as the type docs/api.md declares (a number as a JSON number, "
                           "an integer without a point)") from None
    except msgspec.DecodeError:
        return  # not JSON: Litestar's parse says so


PARAM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def _param_name(name: str) -> str:
    """A query parameter's name for an error: quoted when it is a plain word (a misspelt
    ``mod``), else only its length: the URL is the caller's, and an error does not repeat
    it (markup or a long text in it)."""
    if PARAM_NAME.fullmatch(name):
        return repr(name)
    return f"(a name of {len(name)} characters that is not a plain word)"


# how a query's number and flag are written (docs/api.md): Litestar also took ``420.0``,
# ``4.2e2`` and ``-0`` as the mode 420 or 0, and ``1`` as true, which a proxy or log in
# front reads as other text than the daemon's number
QUERY_FORMS: dict[type, tuple[re.Pattern[str], str]] = {
    int: (re.compile(r"0|-?[1-9][0-9]{0,18}"), "a decimal integer (digits, no sign but -, "
          "no point, exponent or leading zero)"),
    bool: (re.compile(r"true|false"), "true or false"),
}


def check_query(request: Request[Any, Any, Any]) -> None:
    """InvalidInput (400) for a query parameter the route does not take, or one given
    twice, naming it: as a JSON body's unknown field or repeated key. Litestar ignored
    both: ``?path=/a&path=/b`` wrote one of the two files (which one is a parser's choice:
    a proxy or a log in front may read the other), and a misspelt ``?mod=384`` wrote the
    file with the default mode, silently. A number or flag not written as QUERY_FORMS says
    is refused too."""
    handler = request.route_handler
    if is_public(handler):
        return
    kinds = {name: f.annotation for name, f in handler.parsed_fn_signature.parameters.items()
             if isinstance(f.kwarg_definition, QueryParameter)}
    takes = sorted(kinds)
    route = f"{request.method} {min(handler.paths)}"
    seen: set[str] = set()
    for name, value in request.query_params.multi_items():
        if name not in takes:
            allowed = ("it takes " + ", ".join(takes)) if takes else "it takes none"
            raise InvalidInput(f"unknown query parameter {_param_name(name)} for {route}: "
                               f"{allowed} (docs/api.md)")
        if name in seen:
            raise InvalidInput(f"query parameter {_param_name(name)} is given twice; send "
                               "each query parameter once")
        seen.add(name)
        form = QUERY_FORMS.get(kinds[name])
        if form is not None and not form[0].fullmatch(value):
            raise InvalidInput(f"query parameter {_param_name(name)} of {route} must be "
                               f"{form[1]}, got {shown(value, 40)}")


def ctl_dep(request: Request[Any, Any, Any]) -> Controller:
    controller: Controller = request.app.state.controller
    return controller


def is_public(handler: BaseRouteHandler) -> bool:
    """The only routes a TCP caller may use without the token: liveness (``opt public``)
    and the OpenAPI document (the router under OPENAPI.path). Decided on the route that
    matched, never on the request's path."""
    if handler.opt.get("public") is True:
        return True
    return any(isinstance(layer, Router) and layer.path == OPENAPI.path
               for layer in handler.ownership_layers)


# -- routes -------------------------------------------------------------------
@get("/healthz", opt={"public": True}, sync_to_thread=False)
def healthz() -> Health:
    return Health(status="ok", version=forkd.__version__)


@get(
    "/metrics",
    media_type="text/plain; version=0.0.4",
    responses=ERRORS,
    sync_to_thread=True,
)
def metrics_endpoint(ctl: Ctl) -> bytes:
    ctl.metrics.running.set(sum(1 for s in ctl.backend.sandboxes() if s.status == "running"))
    return generate_latest(ctl.metrics.registry)


@get("/v1/snapshots", responses=ERRORS, sync_to_thread=True)
def list_snapshots(ctl: Ctl) -> list[LayerInfo]:
    return ctl.backend.snapshots()


@get("/v1/snapshots/{ref:path}", responses=ERRORS, sync_to_thread=True)
def get_snapshot(ctl: Ctl, ref: FromPath[str]) -> dict[str, Any]:
    return ctl.backend.snapshot(ref.lstrip("/"))


@delete(
    "/v1/snapshots/{ref:path}",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def delete_snapshot(
    request: Req, ctl: Ctl, ref: FromPath[str], cascade: FromQuery[bool] = False
) -> Removed:
    result = ctl.backend.delete_snapshot(ref.lstrip("/"), cascade)
    audited(request, ctl, "snapshot.delete", ref, "ok", removed=result.removed)
    return result


@post("/v1/compact", responses=ERRORS, status_code=201, sync_to_thread=True)
def compact(request: Req, ctl: Ctl, data: JSONBody[CompactRequest]) -> LayerInfo:
    result = ctl.backend.compact(data)
    audited(request, ctl, "snapshot.compact", data.ref, "ok", to=data.to)
    return result


@post("/v1/sandboxes", responses=ERRORS, status_code=201, sync_to_thread=True)
def spawn(request: Req, ctl: Ctl, data: JSONBody[SpawnRequest]) -> SpawnResult:
    start = time.perf_counter()
    result = ctl.backend.spawn(data)
    ctl.metrics.spawn_seconds.observe(time.perf_counter() - start)
    ctl.metrics.spawned.inc(len(result.sandboxes))
    unclaimed(request, ctl, data, result)
    audited(
        request,
        ctl,
        "sandbox.create",
        data.tag,
        "ok",
        ids=[s.id for s in result.sandboxes],
        errors=len(result.errors),
    )
    return result


def unclaimed(request: Req, ctl: Controller, data: SpawnRequest, result: SpawnResult) -> None:
    """The sandboxes of a spawn whose client went away (or whose token was revoked) while
    they started are killed, and the spawn is Stopped: nobody was told their ids, and
    they ran (with no timeout, for ever) counted against that client's share of the VMs,
    a client that gave up on a slow spawn (RemoteBackend's deadline, a cancelled MCP
    call) finding its share taken by sandboxes it never had. A spawn gives all it was
    asked for or none."""
    stop = CALLER_STOP.get()
    if stop is None or not stop() or not result.sandboxes:
        return
    ids = [s.id for s in result.sandboxes]
    for sandbox_id in ids:
        with contextlib.suppress(ForkdError):
            ctl.backend.kill(sandbox_id)
    audited(request, ctl, "sandbox.create", data.tag, "unclaimed", ids=ids, why=stop.reason)
    raise Stopped(stop.reason)


@get("/v1/sandboxes", responses=ERRORS, sync_to_thread=True)
def list_sandboxes(ctl: Ctl) -> list[SandboxInfo]:
    return ctl.backend.sandboxes()


@get("/v1/sandboxes/{sandbox_id:str}", responses=ERRORS, sync_to_thread=True)
def get_sandbox(ctl: Ctl, sandbox_id: FromPath[str]) -> SandboxInfo:
    return ctl.backend.sandbox(sandbox_id)


@delete(
    "/v1/sandboxes/{sandbox_id:str}",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def kill_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> SandboxInfo:
    result = ctl.backend.kill(sandbox_id)
    audited(request, ctl, "sandbox.delete", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/extend",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def extend_sandbox(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[ExtendRequest]
) -> SandboxInfo:
    result = ctl.backend.extend(sandbox_id, data)
    audited(request, ctl, "sandbox.extend", sandbox_id, "ok", seconds=data.seconds)
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/pause",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def pause_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> SandboxInfo:
    result = ctl.backend.pause(sandbox_id)
    audited(request, ctl, "sandbox.pause", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/resume",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def resume_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> SandboxInfo:
    result = ctl.backend.resume(sandbox_id)
    audited(request, ctl, "sandbox.resume", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/exec",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def exec_in(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[ExecRequest]
) -> ExecResult:
    result = ctl.backend.exec(sandbox_id, data)
    audited(request, ctl, "sandbox.exec", sandbox_id, "ok", argv=data.argv[:8])
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/exec/stream",
    status_code=200,
    sync_to_thread=True,
    media_type="application/x-ndjson",
    responses={200: STREAM, **ERRORS},
)
def exec_stream(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[ExecRequest]
) -> Stream:
    ctl.backend.sandbox(sandbox_id)  # an unknown sandbox is a 404, not a 200 with an error
    # what was asked is recorded when the stream starts ("started": it may still fail), how
    # it ended when it ends: "ok", "failed" (within the failed budget) or "cut" (its client
    # left); recording "ok" before anything ran claimed commands that never ran
    audited(request, ctl, "sandbox.exec", sandbox_id, "started", argv=data.argv[:8],
            stream=True)
    client = REQUEST_CLIENT.get()

    def ended(result: str, detail: dict[str, Any]) -> None:
        if result == "failed":
            ctl.failed.record(ctl.transport, peer(request), "sandbox.exec",
                              audit_value(sandbox_id, MAX_TARGET), "failed", client=client,
                              stream=True, **{k: audit_value(v) for k, v in detail.items()})
        else:
            audited(request, ctl, "sandbox.exec", sandbox_id, result, stream=True, **detail)

    frames = ctl.backend.exec_stream(sandbox_id, data)
    return Stream(ndjson(frames, api.HEARTBEAT_S, ended, store_home(ctl)),
                  media_type="application/x-ndjson")


STREAM_FRAMES = 16  # frames of a streamed command waiting to be sent to a client, at most
FILE_CHUNKS = 4  # chunks of a file (1 MiB each) waiting to be sent to a client, at most
FIRST_CHUNK_WAIT_S = 5.0  # a file's answer starts after this even before its first chunk
# and bytes of them: one stream's, and all of this process's (backend.Handoff's are apart)
RELAY_BYTES_EACH = 2 << 20
RELAY_BYTES = 64 << 20
RELAY_BUDGET = ByteBudget(RELAY_BYTES)
_END = object()  # what follows the last item in relayed's queue


async def relayed(
    items: Transfer[T], heartbeat: float | None, size: int
) -> AsyncGenerator[T | None, None]:
    """``items`` produced in a thread (the backend blocks) and handed to the event loop,
    None after every ``heartbeat`` seconds without one (never, for None); the iterator's
    exception is raised here after the items before it. At most ``size`` wait for a slow
    client. Once the client is gone (this generator is closed) the producer stops
    and closes ``items``: a command is killed with its process group
    (LocalBackend.exec_stream), a file's transfer ends; ``items`` is abandoned at once
    (thread-safe), even while the producer waits in it for an item that never comes.
    Items wait within RELAY_BYTES_EACH bytes, and all but each stream's first within
    RELAY_BYTES with the other streams' (backend.Waiting; the producer waits for room)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue(size)
    gone = threading.Event()
    waiting = Waiting(RELAY_BYTES_EACH, RELAY_BUDGET)

    async def put(item: object) -> bool:
        # In this task (asyncio.timeout, not wait_for, which puts in a task of its own):
        # the item goes in and ``gone`` is read in one step of the loop, so the reader's
        # end (which sets ``gone`` and drains the queue in one step) is either after both
        # (True: the reader or its drain takes the item and its bytes) or before both
        # (False: nobody takes it, the caller gives its bytes back). With wait_for the
        # reader could take the last item between the two, and its bytes were given back
        # twice (IndexError in the producer thread).
        try:
            async with asyncio.timeout(0.5):
                await queue.put(item)
        except TimeoutError:
            return False
        return not gone.is_set()

    def deliver(item: object) -> bool:
        if not waiting.take(item, gone):
            return False
        while not gone.is_set():
            try:
                if asyncio.run_coroutine_threadsafe(put(item), loop).result():
                    return True
            except RuntimeError:  # the event loop is closed: the daemon stops
                break
        waiting.untake()
        return False

    def produce() -> None:
        try:
            for item in items:
                if not deliver(item):
                    return
        except Exception as exc:  # raised in the client's coroutine below
            deliver(exc)
        finally:
            items.close()  # tells the backend
            deliver(_END)

    threading.Thread(target=produce, name="forkd-relay", daemon=True).start()
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), heartbeat)
            except TimeoutError:
                yield None
                continue
            waiting.taken()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]  # what items gave: a T
    finally:
        gone.set()
        # the producer may be waiting in next(items) for an item that never comes (a
        # command that prints nothing): tell the backend now, from here (thread-safe)
        items.abandon()
        while not queue.empty():  # what waits is dropped: its bytes are free for others
            queue.get_nowait()
            waiting.taken()


async def ndjson(frames: Transfer[ExecFrame], heartbeat: float,
                 ended: Callable[[str, dict[str, Any]], None] | None = None,
                 home: Path | None = None) -> AsyncIterator[bytes]:
    """The frames as JSON lines, with an empty frame ``{}`` for every heartbeat (so
    clients and proxies can tell a quiet command from a dead connection), and an
    ``error`` frame if it fails (relayed: bounded, and ended when the client is gone),
    said as an error answer says it (error_answer, ``home`` the store's: the frame named
    this host's directories, which the same error answered by POST …/exec hid).
    ``ended`` is told how the stream ended: "ok" (with the command's status and exit
    code), "failed" (with the error sent) or "cut" (the client left first)."""
    outcome: tuple[str, dict[str, Any]] = ("cut", {})
    try:
        async with contextlib.aclosing(relayed(frames, heartbeat, STREAM_FRAMES)) as relay:
            async for frame in relay:
                if frame is not None and frame.result is not None:
                    outcome = ("ok", {"status": frame.result.status,
                                      "exit_code": frame.result.exit_code})
                elif frame is not None and frame.error is not None:
                    outcome = ("failed", {"error": frame.error.message})
                yield b"{}\n" if frame is None else msgspec.json.encode(frame) + b"\n"
    except Exception as exc:  # the client gets it as its error frame
        error = error_answer(exc, home)[1]
        outcome = ("failed", {"error": error.message})
        yield msgspec.json.encode(ExecFrame(error=error)) + b"\n"
    finally:
        if ended is not None:
            ended(*outcome)


class prepended(Iterator[T]):
    """``first``, then ``rest``: a Transfer, whose ``close`` and ``abandon`` are passed on
    to ``rest`` (a chain would not)."""

    def __init__(self, first: T, rest: Transfer[T]) -> None:
        self._first: list[T] = [first]
        self._rest = rest

    def __next__(self) -> T:
        if self._first:
            return self._first.pop()
        return next(self._rest)

    def close(self) -> None:
        self._rest.close()

    def abandon(self) -> None:
        self._rest.abandon()


async def passed_on(chunks: Transfer[bytes]) -> AsyncIterator[bytes]:
    """A file's chunks as the backend gives them (relayed: bounded, and the transfer ends
    when the client is gone); a failure midway ends the connection before the body is
    complete, so the client sees a cut transfer, never a shorter file."""
    async with contextlib.aclosing(relayed(chunks, None, FILE_CHUNKS)) as relay:
        async for chunk in relay:
            if chunk is not None:
                yield chunk


@post(
    "/v1/sandboxes/{sandbox_id:str}/eval",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def eval_in(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[EvalRequest]
) -> EvalResult:
    result = ctl.backend.eval(sandbox_id, data)
    audited(request, ctl, "sandbox.eval", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/run_code",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def run_code(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[RunCodeRequest]
) -> RunCodeResult:
    result = ctl.backend.run_code(sandbox_id, data)
    audited(request, ctl, "sandbox.run_code", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/processes",
    responses=ERRORS,
    status_code=201,
    sync_to_thread=True,
)
def process_start(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[ProcessStartRequest]
) -> ProcessInfo:
    result = ctl.backend.process_start(sandbox_id, data)
    audited(
        request,
        ctl,
        "sandbox.process.start",
        sandbox_id,
        "ok",
        argv=data.argv[:8],
        handle=result.handle,
    )
    return result


@get(
    "/v1/sandboxes/{sandbox_id:str}/processes",
    responses=ERRORS,
    sync_to_thread=True,
)
def processes(ctl: Ctl, sandbox_id: FromPath[str]) -> list[ProcessInfo]:
    return ctl.backend.processes(sandbox_id)


@post(
    "/v1/sandboxes/{sandbox_id:str}/processes/{handle:str}/wait",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def process_wait(
    ctl: Ctl,
    sandbox_id: FromPath[str],
    handle: FromPath[str],
    data: JSONBody[ProcessWaitRequest],
) -> ProcessWaitResult:
    return ctl.backend.process_wait(sandbox_id, handle, data)


@post(
    "/v1/sandboxes/{sandbox_id:str}/processes/{handle:str}/stdin",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def process_stdin(
    request: Req,
    ctl: Ctl,
    sandbox_id: FromPath[str],
    handle: FromPath[str],
    data: JSONBody[ProcessStdinRequest],
) -> StdinWritten:
    result = ctl.backend.process_stdin(sandbox_id, handle, data)
    audited(
        request,
        ctl,
        "sandbox.process.stdin",
        sandbox_id,
        "ok",
        handle=handle,
        bytes=len(data.data or b""),
        close=data.close,
    )
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/processes/{handle:str}/kill",
    responses=ERRORS,
    status_code=200,
    sync_to_thread=True,
)
def process_kill(
    request: Req,
    ctl: Ctl,
    sandbox_id: FromPath[str],
    handle: FromPath[str],
    data: JSONBody[ProcessKillRequest],
) -> ProcessSignaled:
    result = ctl.backend.process_kill(sandbox_id, handle, data)
    audited(
        request, ctl, "sandbox.process.kill", sandbox_id, "ok", handle=handle, signal=result.signal
    )
    return result


@put(
    "/v1/sandboxes/{sandbox_id:str}/files",
    responses=ERRORS,
    status_code=204,
    sync_to_thread=True,
    request_max_body_size=MAX_FILE_BYTES,
)
def write_file(
    request: Req,
    ctl: Ctl,
    sandbox_id: FromPath[str],
    path: FromQuery[str],
    body: RawBody,
    mode: FromQuery[int] = 0o644,
) -> None:
    ctl.backend.write_file(sandbox_id, path, body, mode)
    audited(request, ctl, "sandbox.file.write", sandbox_id, "ok", path=path, bytes=len(body))


FILE = ResponseSpec(
    bytes,
    media_type="application/octet-stream",
    description="the file's bytes, passed on as the guest sends them (chunked)",
    generate_examples=False,
)


@get(
    "/v1/sandboxes/{sandbox_id:str}/files",
    sync_to_thread=True,
    media_type="application/octet-stream",
    responses={200: FILE, **ERRORS},
)
def read_file(ctl: Ctl, sandbox_id: FromPath[str], path: FromQuery[str]) -> Stream:
    """The file streamed: the daemon holds a few chunks of it, never the whole file (up to
    4 GiB, a size the guest decides). A bad path, an unknown sandbox or a missing file is
    its error status, decided before the answer starts; a transfer that fails later ends
    the connection before the body is complete. The answer starts after the first chunk,
    or after FIRST_CHUNK_WAIT_S without one (a FIFO nobody writes, a slow device): a
    client that leaves then ends the transfer (relayed), where a handler still waiting
    for its first chunk would never learn that it left."""
    chunks = ctl.backend.read_file(sandbox_id, path)
    within = getattr(chunks, "next_within", None)
    try:
        first = within(FIRST_CHUNK_WAIT_S) if within is not None else next(chunks)
    except StopIteration:
        first = b""
    rest = chunks if first is PENDING else prepended(first, chunks)
    return Stream(passed_on(rest), media_type="application/octet-stream")


@post(
    "/v1/sandboxes/{sandbox_id:str}/branch",
    responses=ERRORS,
    status_code=201,
    sync_to_thread=True,
)
def branch(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[BranchRequest]
) -> BranchResult:
    result = ctl.backend.branch(sandbox_id, data)
    audited(request, ctl, "sandbox.branch", sandbox_id, "ok", tag=data.tag, force=data.force)
    return result


@get("/v1/pools", responses=ERRORS, sync_to_thread=True)
def list_pools(ctl: Ctl) -> list[PoolStatus]:
    return ctl.backend.pools()


@post("/v1/pools", responses=ERRORS, status_code=200, sync_to_thread=True)
def fill_pool(request: Req, ctl: Ctl, data: JSONBody[PoolRequest]) -> PoolStatus:
    result = ctl.backend.fill_pool(data)
    audited(request, ctl, "pool.fill", data.tag, "ok", k=data.k)
    return result


@delete(
    "/v1/pools/{tag:path}", responses=ERRORS, status_code=200, sync_to_thread=True
)
def remove_pool(request: Req, ctl: Ctl, tag: FromPath[str]) -> PoolRemoved:
    result = ctl.backend.remove_pool(tag.lstrip("/"))
    audited(request, ctl, "pool.delete", tag, "ok")
    return result


ROUTES = [
    healthz,
    metrics_endpoint,
    list_snapshots,
    get_snapshot,
    delete_snapshot,
    compact,
    spawn,
    list_sandboxes,
    get_sandbox,
    kill_sandbox,
    extend_sandbox,
    pause_sandbox,
    resume_sandbox,
    exec_in,
    exec_stream,
    eval_in,
    run_code,
    process_start,
    processes,
    process_wait,
    process_stdin,
    process_kill,
    write_file,
    read_file,
    branch,
    list_pools,
    fill_pool,
    remove_pool,
]


def create_app(
    backend: PoolBackend | None,
    audit: AuditLog | None,
    metrics: ControllerMetrics | None,
    token: Token | bytes | None,
) -> Litestar:
    """One listener's app; the Unix-socket app has no token, the TCP app requires one
    (a Token, or fixed bytes: nothing shorter than MIN_TOKEN_BYTES is ever served)."""
    if isinstance(token, bytes):
        token = Token(token)
    app = Litestar(
        route_handlers=ROUTES,
        guards=[require_token],  # app-wide: a route is guarded unless is_public says otherwise
        before_request=check_request,
        request_max_body_size=MAX_JSON_BYTES,
        dependencies={"ctl": Provide(ctl_dep, sync_to_thread=False)},
        exception_handlers={Exception: error_response},
        middleware=[request_share, body_budget, caller_watch],
        on_startup=[set_workers],
        openapi_config=OPENAPI,
        debug=False,
    )
    if backend is not None and audit is not None and metrics is not None:
        app.state.controller = Controller(backend, audit, metrics, token)
    return app


def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI schema (what /schema/openapi.json serves), without a running daemon."""
    schema: dict[str, Any] = create_app(None, None, None, None).openapi_schema.to_schema()
    return schema


TS_HEADER = """\
// The controller API's types, generated from forkd.controller.api (through the OpenAPI
// document) by forkd.controller.app.typescript_types: do not edit. Regenerate with
//   python3 -P -c 'from forkd.controller.app import typescript_types as t; print(t(), end="")' \\
//     > sdk/typescript/src/api.d.ts
"""


def typescript_types() -> str:
    """The TypeScript declarations of every schema of openapi_document() (sdk/typescript)."""
    schemas: dict[str, Any] = openapi_document()["components"]["schemas"]
    out = [TS_HEADER]
    for name in sorted(schemas):
        out.append(ts_declaration(name, schemas[name]))
    return "\n".join(out)


def ts_declaration(name: str, schema: dict[str, Any]) -> str:
    if schema.get("type") != "object" or "properties" not in schema:
        return f"export type {name} = {ts_type(schema)};\n"
    required = set(schema.get("required", []))
    lines = [f"export interface {name} {{"]
    for prop, sub in schema["properties"].items():
        optional = "" if prop in required else "?"
        lines.append(f"  {prop}{optional}: {ts_type(sub)};")
    lines.append("}\n")
    return "\n".join(lines)


def ts_type(schema: dict[str, Any]) -> str:
    """A JSON schema (the subset Litestar writes for msgspec types) as a TypeScript type."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return " | ".join(dict.fromkeys(ts_type(s) for s in schema[key]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(ts_type({**schema, "type": k}) for k in kind)
    if kind == "array":
        item = ts_type(schema.get("items", {}))
        return f"({item})[]" if "|" in item else f"{item}[]"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"Record<string, {ts_type(extra) if isinstance(extra, dict) else 'unknown'}>"
    simple = {
        "string": "string",
        "integer": "number",
        "number": "number",
        "boolean": "boolean",
        "null": "null",
    }
    return simple.get(str(kind), "unknown")
