"""Metrics (Prometheus, one registry per hub: no globals); the audit log is forkd.audit."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from sqlalchemy import func, select

from forkd.hub.db import Database
from forkd.hub.models import Blob, Repository

log = logging.getLogger("forkd.hub")

ROUTE_RE = re.compile(r"^/v2/.+/(manifests|blobs/uploads|blobs|tags|referrers)(?:/|$)")
FIXED_ROUTES = {"/token", "/v2", "/healthz", "/metrics"}


def route_of(path: str) -> str:
    """A low-cardinality label for a request path (never the repository name)."""
    m = ROUTE_RE.match(path)
    if m:
        return m.group(1)
    if path.startswith("/api/"):
        return "api"
    path = path.rstrip("/")
    return path[1:] if path in FIXED_ROUTES else "other"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "forkd_hub_requests", "HTTP requests served", ["method", "route", "status"], registry=r
        )
        self.duration = Histogram(
            "forkd_hub_request_duration_seconds",
            "Time to answer a request",
            ["route"],
            registry=r,
        )
        self.bytes_in = Counter("forkd_hub_blob_bytes_received", "Blob bytes received", registry=r)
        self.bytes_out = Counter("forkd_hub_blob_bytes_sent", "Blob bytes sent", registry=r)
        self.auth_failures = Counter(
            "forkd_hub_auth_failures", "Refused logins and tokens", registry=r
        )
        self.blobs = Gauge("forkd_hub_blobs", "Blobs in the store", registry=r)
        self.blob_bytes = Gauge("forkd_hub_blob_bytes", "Bytes of blobs in the store", registry=r)
        self.repositories = Gauge("forkd_hub_repositories", "Repositories", registry=r)

    async def render(self, db: Database) -> bytes:
        async with db.reading() as session:
            count, total = (await session.execute(select(func.count(), func.sum(Blob.size)))).one()
            repos = await session.scalar(select(func.count()).select_from(Repository))
        self.blobs.set(count or 0)
        self.blob_bytes.set(total or 0)
        self.repositories.set(repos or 0)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: count and time every HTTP request by method, route kind and status."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def observe(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            route = route_of(scope.get("path", ""))
            self.metrics.requests.labels(scope.get("method", ""), route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - start)


class StreamCut(Exception):
    """A response the hub cut on purpose after its headers were sent (a download whose
    reader lost pull): no error document can follow, so the connection is closed short of
    its ``Content-Length``. ``str()`` says why, in one line, for the hub's log."""

    level = logging.WARNING  # of its line in the hub's log (``CutStreams``)


# Set in the request's task when ``CutStreams`` ended its response: the server's own
# "returned without completing response" line for it says nothing the hub's line did not.
_CUT: ContextVar[bool] = ContextVar("forkd_hub_stream_cut", default=False)
UNFINISHED = "ASGI callable returned without completing response."


def _cut_in(exc: BaseException | None, depth: int = 0) -> StreamCut | None:
    """The ``StreamCut`` behind ``exc``: itself, its cause or context (the framework
    raises its own error *from* it), or one in an exception group."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, StreamCut):
        return exc
    inner: Iterator[BaseException | None] = iter(
        [*getattr(exc, "exceptions", ()), exc.__cause__, exc.__context__]
    )
    return next((c for e in inner if (c := _cut_in(e, depth + 1)) is not None), None)


class CutStreams:
    """ASGI middleware: a response ended by a ``StreamCut`` is one line in the hub's log
    (WARNING: method, route kind, why), not an "Exception in ASGI application" traceback.
    It returns without finishing the response, so the server closes the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            cut = _cut_in(exc)
            if cut is None or scope["type"] != "http":
                raise
            log.log(
                cut.level,
                "%s %s response cut short: %s",
                scope.get("method", ""),
                route_of(scope.get("path", "")),
                cut,
            )
            _CUT.set(True)


class QuietCut(logging.Filter):
    """On the server's error logger: drop its one-line notice that the app left a
    response unfinished when the hub cut it on purpose (``CutStreams`` logged why)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.msg == UNFINISHED)


QUIET_CUT = QuietCut()
