"""The controller's REST API (Litestar): snapshots and sandboxes of this host, v1.

Served on a Unix socket (access by file mode) and optionally on TCP, where
every route but ``/healthz`` needs ``Authorization: Bearer <token>``. Errors
are ``{"error": {"type", "message", "exit_code"}}`` with an HTTP status from
the error family. Every write and every refused token goes to the audit log.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.exceptions import NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, FromQuery, JSONBody, RawBody
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

import forkd
from forkd.audit import AuditLog
from forkd.controller.backend import PoolBackend, unb64
from forkd.errors import (
    ChainError,
    Conflict,
    ForkdError,
    IntegrityError,
    InvalidInput,
    NotFound,
)

STATUS: list[tuple[type[ForkdError], int]] = [
    (InvalidInput, 400),
    (NotFound, 404),
    (Conflict, 409),
    (IntegrityError, 422),
    (ChainError, 422),
]
MAX_FILE_BYTES = 64 << 20
MIN_TOKEN_BYTES = 32  # a bearer token shorter than this is refused at start
MAX_TOKEN_BYTES = 4096  # and one longer (it must fit in a request header)
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


@dataclass
class Controller:
    """One listener's view of the daemon: the Unix socket (token None) or TCP (token set)."""

    backend: PoolBackend
    audit: AuditLog
    metrics: ControllerMetrics
    token: bytes | None  # a checked_token; required on this listener when set

    @property
    def transport(self) -> str:
        return "unix-socket" if self.token is None else "tcp"


Ctl = NamedDependency[Controller]
Req = Request[Any, Any, Any]


# -- request bodies -----------------------------------------------------------
@dataclass
class SpawnRequest:
    tag: str
    n: int = 1
    memory_limit_mib: int | None = None
    netns: bool = False
    sandbox: bool = True  # QEMU's -sandbox on
    prewarm: int | None = None  # after serving: keep this many processes waiting for the tag
    timeout: float | None = None  # seconds until each sandbox is killed or paused
    on_timeout: str = "kill"  # "kill" or "pause"
    cpus: float | None = None  # CPU time, in CPUs (0.5 = half of one core)
    pids_max: int | None = None  # host tasks of the sandbox's QEMU
    disk_bps: int | None = None  # disk bytes/s, read + write
    disk_iops: int | None = None  # disk operations/s, read + write
    net_kbit: int | None = None  # network kbit/s to the sandbox (tbf on its tap)


@dataclass
class ExtendRequest:
    seconds: float


@dataclass
class PoolRequest:
    tag: str
    k: int
    memory_limit_mib: int | None = None
    netns: bool = False
    sandbox: bool = True
    wait: bool = False  # answer once the k processes are started


@dataclass
class ExecRequest:
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin_b64: str | None = None
    timeout: float | None = None


@dataclass
class EvalRequest:
    code: str
    timeout: float = 300.0


@dataclass
class BranchRequest:
    tag: str
    force: bool = False


@dataclass
class CompactRequest:
    ref: str
    to: str


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
    """The token of ``Authorization: Bearer <token>``, or b"" when there is none."""
    scheme, _sep, value = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return value.strip().encode("latin-1", errors="replace")


def token_matches(presented: bytes, expected: bytes) -> bool:
    """Constant-time comparison; an empty token never matches, whatever was configured."""
    return bool(presented) and bool(expected) and hmac.compare_digest(presented, expected)


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


def require_token(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    ctl: Controller = connection.app.state.controller
    if ctl.token is None:
        return
    if not token_matches(presented_token(connection), ctl.token):
        ctl.audit.record("-", peer(connection), "auth", connection.url.path, "denied")
        raise NotAuthorizedException(
            "missing or wrong bearer token", headers={"WWW-Authenticate": 'Bearer realm="forkd"'}
        )


def audited(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    action: str,
    target: str,
    result: str,
    **detail: Any,
) -> None:
    ctl.audit.record(ctl.transport, peer(request), action, target, result, **detail)


def error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    ctl: Controller = request.app.state.controller
    if isinstance(exc, NotAuthorizedException):
        return Response(
            {"error": {"type": "Unauthorized", "message": exc.detail, "exit_code": 8}},
            status_code=401,
            headers=exc.headers,
        )
    if not isinstance(exc, ForkdError):
        status = getattr(exc, "status_code", 500)
        message = getattr(exc, "detail", str(exc)) if status < 500 else "internal error"
        return Response(
            {"error": {"type": "HTTPError", "message": message, "exit_code": 1}}, status_code=status
        )
    family = next(((cls, code) for cls, code in STATUS if isinstance(exc, cls)), None)
    status = family[1] if family else 500
    if request.method != "GET":
        audited(request, ctl, request.method, request.url.path, "failed", error=str(exc))
    kind = family[0].__name__ if family else type(exc).__name__
    return Response(
        {"error": {"type": kind, "message": str(exc), "exit_code": exc.exit_code}},
        status_code=status,
    )


def ctl_dep(request: Request[Any, Any, Any]) -> Controller:
    controller: Controller = request.app.state.controller
    return controller


# -- routes -------------------------------------------------------------------
@get("/healthz", sync_to_thread=False)
def healthz() -> dict[str, str]:
    return {"status": "ok", "version": forkd.__version__}


@get(
    "/metrics", media_type="text/plain; version=0.0.4", guards=[require_token], sync_to_thread=True
)
def metrics_endpoint(ctl: Ctl) -> bytes:
    ctl.metrics.running.set(sum(1 for s in ctl.backend.sandboxes() if s["status"] == "running"))
    return generate_latest(ctl.metrics.registry)


@get("/v1/snapshots", guards=[require_token], sync_to_thread=True)
def list_snapshots(ctl: Ctl) -> list[dict[str, Any]]:
    return ctl.backend.snapshots()


@get("/v1/snapshots/{ref:path}", guards=[require_token], sync_to_thread=True)
def get_snapshot(ctl: Ctl, ref: FromPath[str]) -> dict[str, Any]:
    return ctl.backend.snapshot(ref.lstrip("/"))


@delete("/v1/snapshots/{ref:path}", guards=[require_token], status_code=200, sync_to_thread=True)
def delete_snapshot(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    ref: FromPath[str],
    cascade: FromQuery[bool] = False,
) -> dict[str, Any]:
    removed = ctl.backend.delete_snapshot(ref.lstrip("/"), cascade)
    audited(request, ctl, "snapshot.delete", ref, "ok", removed=removed)
    return {"removed": removed}


@post("/v1/compact", guards=[require_token], status_code=201, sync_to_thread=True)
def compact(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    data: JSONBody[CompactRequest],
) -> dict[str, Any]:
    result = ctl.backend.compact(data.ref, data.to)
    audited(request, ctl, "snapshot.compact", data.ref, "ok", to=data.to)
    return result


@post("/v1/sandboxes", guards=[require_token], status_code=201, sync_to_thread=True)
def spawn(request: Req, ctl: Ctl, data: JSONBody[SpawnRequest]) -> dict[str, Any]:
    start = time.perf_counter()
    result = ctl.backend.spawn(
        data.tag,
        data.n,
        data.memory_limit_mib,
        data.netns,
        data.sandbox,
        data.prewarm,
        timeout=data.timeout,
        on_timeout=data.on_timeout,
        cpus=data.cpus,
        pids_max=data.pids_max,
        disk_bps=data.disk_bps,
        disk_iops=data.disk_iops,
        net_kbit=data.net_kbit,
    )
    ctl.metrics.spawn_seconds.observe(time.perf_counter() - start)
    ctl.metrics.spawned.inc(len(result["sandboxes"]))
    audited(
        request, ctl, "sandbox.create", data.tag, "ok", ids=[s["id"] for s in result["sandboxes"]]
    )
    return result


@get("/v1/sandboxes", guards=[require_token], sync_to_thread=True)
def list_sandboxes(ctl: Ctl) -> list[dict[str, Any]]:
    return ctl.backend.sandboxes()


@get("/v1/sandboxes/{sandbox_id:str}", guards=[require_token], sync_to_thread=True)
def get_sandbox(ctl: Ctl, sandbox_id: FromPath[str]) -> dict[str, Any]:
    return ctl.backend.sandbox(sandbox_id)


@delete(
    "/v1/sandboxes/{sandbox_id:str}", guards=[require_token], status_code=200, sync_to_thread=True
)
def kill_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> dict[str, Any]:
    result = ctl.backend.kill(sandbox_id)
    audited(request, ctl, "sandbox.delete", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/extend",
    guards=[require_token],
    status_code=200,
    sync_to_thread=True,
)
def extend_sandbox(
    request: Req, ctl: Ctl, sandbox_id: FromPath[str], data: JSONBody[ExtendRequest]
) -> dict[str, Any]:
    result = ctl.backend.extend(sandbox_id, data.seconds)
    audited(request, ctl, "sandbox.extend", sandbox_id, "ok", seconds=data.seconds)
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/pause",
    guards=[require_token],
    status_code=200,
    sync_to_thread=True,
)
def pause_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> dict[str, Any]:
    result = ctl.backend.pause(sandbox_id)
    audited(request, ctl, "sandbox.pause", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/resume",
    guards=[require_token],
    status_code=200,
    sync_to_thread=True,
)
def resume_sandbox(request: Req, ctl: Ctl, sandbox_id: FromPath[str]) -> dict[str, Any]:
    result = ctl.backend.resume(sandbox_id)
    audited(request, ctl, "sandbox.resume", sandbox_id, "ok")
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/exec",
    guards=[require_token],
    status_code=200,
    sync_to_thread=True,
)
def exec_in(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    sandbox_id: FromPath[str],
    data: JSONBody[ExecRequest],
) -> dict[str, Any]:
    stdin = unb64(data.stdin_b64, "stdin_b64") if data.stdin_b64 is not None else None
    result = ctl.backend.exec(sandbox_id, data.argv, data.env, data.cwd, stdin, data.timeout)
    audited(request, ctl, "sandbox.exec", sandbox_id, "ok", argv=data.argv[:8])
    return result


@post(
    "/v1/sandboxes/{sandbox_id:str}/eval",
    guards=[require_token],
    status_code=200,
    sync_to_thread=True,
)
def eval_in(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    sandbox_id: FromPath[str],
    data: JSONBody[EvalRequest],
) -> dict[str, Any]:
    result = ctl.backend.eval(sandbox_id, data.code, data.timeout)
    audited(request, ctl, "sandbox.eval", sandbox_id, "ok")
    return result


@put(
    "/v1/sandboxes/{sandbox_id:str}/files",
    guards=[require_token],
    status_code=204,
    sync_to_thread=True,
    request_max_body_size=MAX_FILE_BYTES,
)
def write_file(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    sandbox_id: FromPath[str],
    path: FromQuery[str],
    body: RawBody,
    mode: FromQuery[int] = 0o644,
) -> None:
    ctl.backend.write_file(sandbox_id, path, body, mode)
    audited(request, ctl, "sandbox.file.write", sandbox_id, "ok", path=path, bytes=len(body))


@get(
    "/v1/sandboxes/{sandbox_id:str}/files",
    guards=[require_token],
    sync_to_thread=True,
    media_type="application/octet-stream",
)
def read_file(ctl: Ctl, sandbox_id: FromPath[str], path: FromQuery[str]) -> bytes:
    return ctl.backend.read_file(sandbox_id, path)


@post(
    "/v1/sandboxes/{sandbox_id:str}/branch",
    guards=[require_token],
    status_code=201,
    sync_to_thread=True,
)
def branch(
    request: Request[Any, Any, Any],
    ctl: Ctl,
    sandbox_id: FromPath[str],
    data: JSONBody[BranchRequest],
) -> dict[str, Any]:
    result = ctl.backend.branch(sandbox_id, data.tag, data.force)
    audited(request, ctl, "sandbox.branch", sandbox_id, "ok", tag=data.tag)
    return result


@get("/v1/pools", guards=[require_token], sync_to_thread=True)
def list_pools(ctl: Ctl) -> list[dict[str, Any]]:
    return ctl.backend.pools()


@post("/v1/pools", guards=[require_token], status_code=200, sync_to_thread=True)
def fill_pool(request: Req, ctl: Ctl, data: JSONBody[PoolRequest]) -> dict[str, Any]:
    result = ctl.backend.fill_pool(
        data.tag, data.k, data.memory_limit_mib, data.netns, data.sandbox, data.wait
    )
    audited(request, ctl, "pool.fill", data.tag, "ok", k=data.k)
    return result


@delete("/v1/pools/{tag:path}", guards=[require_token], status_code=200, sync_to_thread=True)
def remove_pool(request: Req, ctl: Ctl, tag: FromPath[str]) -> dict[str, Any]:
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
    eval_in,
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
    token: bytes | None,
) -> Litestar:
    """One listener's app; the Unix-socket app has no token, the TCP app requires one
    (a checked_token: nothing shorter than MIN_TOKEN_BYTES is ever served)."""
    if token is not None and len(token) < MIN_TOKEN_BYTES:
        raise InvalidInput(f"a bearer token must be at least {MIN_TOKEN_BYTES} bytes")
    app = Litestar(
        route_handlers=ROUTES,
        dependencies={"ctl": Provide(ctl_dep, sync_to_thread=False)},
        exception_handlers={Exception: error_response},
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
