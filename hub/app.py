"""``create_app``: all wiring of the hub in one place."""

from __future__ import annotations

import hmac
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from litestar import Litestar, Request, get
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import (
    HTTPException,
    NotAuthorizedException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.logging import LoggingConfig
from litestar.openapi import OpenAPIConfig
from litestar.types import Scope
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

import forkd
from forkd import jsondoc
from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts, gc
from forkd.hub import retention as retention_rules
from forkd.hub.auth import authenticate, check_host, client_ip, token_endpoint
from forkd.hub.body_budget import BodyBudget, body_size, counted
from forkd.hub.catalog import CatalogController, LineageController
from forkd.hub.compaction import CompactionController, Retention
from forkd.hub.db import MIGRATE_LOCK, sqlstate, transient
from forkd.hub.errors import (
    RegistryError,
    conflict_handler,
    database_error_handler,
    invalid_input_handler,
    registry_error_handler,
    validation_error_handler,
)
from forkd.hub.headers import AnswerHeaders
from forkd.hub.observability import QUIET_CUT, CutStreams, MetricsMiddleware
from forkd.hub.oci.router import api_version, dispatch
from forkd.hub.orgs_api import OrgController, QuotaController, UserController
from forkd.hub.pulls import FLUSH_INTERVAL_S
from forkd.hub.secrets import claim_blob_storage
from forkd.hub.services import Hub
from forkd.hub.settings import CLIENT_PARTS, HubSettings
from forkd.hub.tokens_api import TokenController
from forkd.hub.ui import ui_router
from forkd.hub.ui.account import FORM_MAX
from forkd.hub.ui.api import BODY_MAX as README_BODY_MAX
from forkd.shares import Shares

log = logging.getLogger("forkd.hub")


class HubHttpRequest(Request[object, object, State]):
    """Litestar's request, with a JSON body (the ``data`` of /api/v1 and UI routes)
    checked before Litestar decodes it (forkd/jsondoc.py ``check_body``): bounded in
    nesting (its decoder recurses per level, and a body of a few thousand ``[`` was a
    RecursionError, a 500) and unambiguous (a key twice in one object: msgspec keeps the
    last, other readers the first). Either is a 400, as for manifests."""

    async def json(self) -> Any:
        body = await self.body()
        if len(body) <= jsondoc.INLINE_MAX:
            jsondoc.check_body(body)
        else:  # a README of up to 512 KiB: off the event loop (jsondoc.INLINE_MAX)
            await anyio.to_thread.run_sync(jsondoc.check_body, body)
        return await super().json()


async def bootstrap_admin(hub: Hub) -> None:
    """On an empty database, create the first admin (from settings, else a generated
    password). Replicas starting together on one PostgreSQL take turns (an advisory
    lock), so one creates it and the others find it."""
    async with hub.db.transaction() as session:
        if not hub.db.is_sqlite:
            await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
        if await accounts.has_users(session):
            return
        name = hub.settings.admin_user or "admin"
        password = hub.settings.admin_password or secrets.token_urlsafe(18)
        await accounts.create_user(session, name, password, admin=True)
    if not hub.settings.admin_password:
        # Shown once, on the terminal that started the hub; never logged to files.
        print(f"forkd hub: created admin user {name!r} with password {password}", file=sys.stderr)
    log.info("created admin user %s", name)


async def log_unexpected(exc: Exception, scope: Scope) -> None:
    """Registry errors are answers; anything else is a bug worth a traceback."""
    if isinstance(exc, DBAPIError) and transient(exc):
        log.warning(
            "%s %s: the database ended its transaction (%s); answered 503, retry",
            scope.get("method"), scope.get("path"), sqlstate(exc) or "busy",
        )
        return
    if not isinstance(exc, RegistryError | HTTPException | InvalidInput | Conflict):
        log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)


async def flush_pulls(hub: Hub) -> None:
    while True:
        await anyio.sleep(FLUSH_INTERVAL_S)
        try:
            await hub.pulls.flush(hub.db)
        except Exception:  # a busy or restarting database: the counts wait for next time
            log.warning("could not write pull counts", exc_info=True)


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request[object, object, State], hub: NamedDependency[Hub]) -> bytes:
    """Prometheus text exposition, for the configured ``metrics_token`` (as a Bearer
    token) or a site admin: the counts cover private repositories, and their changes
    tell an outsider when someone pushes to one."""
    token = hub.settings.metrics_token
    header = request.headers.get("authorization", "")
    kind, _, value = header.partition(" ")
    given = value.strip().encode()  # bytes: compare_digest takes str only when ASCII
    if not (token and kind.lower() == "bearer" and hmac.compare_digest(given, token.encode())):
        principal = (await authenticate(hub, request)).principal
        if principal.anonymous:
            raise NotAuthorizedException(
                "metrics need Authorization: Bearer METRICS_TOKEN (the metrics_token "
                "setting) or a site admin's credentials",
                headers={"WWW-Authenticate": f'Bearer realm="{hub.settings.service} metrics"'},
            )
        if not principal.site_admin:
            hub.provoked.record(principal, client_ip(request), "metrics", "-", "denied")
            raise PermissionDeniedException("only site admins and the metrics token read metrics")
    return await hub.metrics.render(hub.db)


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


# The request body limit of every route that sets none of its own: /api/v1's JSON bodies
# (a team, a token, an organisation) are a few hundred bytes. The registry routes take
# any size (uploads: ``upload_max_bytes``), README and UI forms set their own.
API_BODY_MAX = 64 * 1024
# The largest body a route other than a manifest PUT reads whole (body_budget.body_size).
OTHER_BODY_MAX = max(API_BODY_MAX, FORM_MAX, README_BODY_MAX)
HOST_EXEMPT = ("/healthz",)  # answers with no URL; load balancers probe it by address


def create_app(settings: HubSettings) -> Litestar:
    settings = settings.validated()
    hub = Hub.build(settings)
    retention = None
    if settings.compact_deeper_than:
        retention = Retention(hub, settings.compact_deeper_than)
        hub.after_push.append(retention.submit)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            await hub.db.migrate()
        await claim_blob_storage(hub.db, settings, hub.blobs)
        await bootstrap_admin(hub)
        await hub.load_key()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(flush_pulls, hub)
            tasks.start_soon(
                gc.expire_forever,
                hub.db,
                hub.blobs,
                hub.uploads,
                settings.upload_idle_timeout,
                hub.shared,
            )
            if retention is not None:
                await tasks.start(retention.run)  # queues from the first request on
            if settings.retention:
                tasks.start_soon(
                    retention_rules.run,
                    hub.db,
                    settings.retention,
                    hub.audit,
                    settings.retention_interval,
                )
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
        await hub.close()

    def provide_hub() -> Hub:
        return hub

    bodies = BodyBudget(settings.request_bodies_max)
    responses = Shares(settings.response_bytes_max, CLIENT_PARTS)

    def body_of(scope: Any) -> int:
        return body_size(scope, settings.manifest_max_bytes, OTHER_BODY_MAX)

    def host_checked(request: Request[object, object, State]) -> None:
        if request.scope["path"] not in HOST_EXEMPT:  # not ``url``: it parses the Host
            check_host(hub, request)

    app = Litestar(
        route_handlers=[
            api_version,
            dispatch,
            token_endpoint,
            healthz,
            metrics,
            CatalogController,
            LineageController,
            CompactionController,
            TokenController,
            OrgController,
            QuotaController,
            UserController,
            ui_router(hub),
        ],
        openapi_config=OpenAPIConfig(
            title="forkd hub", version=forkd.__version__, path="/api/schema"
        ),
        middleware=[
            AnswerHeaders,  # nosniff on all; private to caches when the request had credentials
            CutStreams,
            lambda app: MetricsMiddleware(app, hub.metrics),
            # request and response bodies held at once, bounded
            lambda app: counted(app, bodies, body_of, responses),
        ],
        dependencies={"hub": Provide(provide_hub, use_cache=True, sync_to_thread=False)},
        request_class=HubHttpRequest,
        request_max_body_size=API_BODY_MAX,
        before_request=host_checked,
        exception_handlers={
            RegistryError: registry_error_handler,
            InvalidInput: invalid_input_handler,
            Conflict: conflict_handler,
            ValidationException: validation_error_handler,
            DBAPIError: database_error_handler,
        },
        lifespan=[lifespan],
        # Log through the "litestar" logger only; the root logger belongs to the process.
        logging_config=LoggingConfig(configure_root_logger=False),
        after_exception=[log_unexpected],
    )
    app.state.hub = hub
    # A response the hub cuts on purpose is one line of its own (CutStreams), not also
    # uvicorn's "returned without completing response" (added once: filters are a set).
    logging.getLogger("uvicorn.error").addFilter(QUIET_CUT)
    return app
