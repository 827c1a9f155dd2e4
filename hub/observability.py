"""Metrics (Prometheus, one registry per hub: no globals); the audit log is forkd.audit."""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from sqlalchemy import func, select

from forkd.hub.db import Database
from forkd.hub.models import Blob, Repository

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
