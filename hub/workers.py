"""``forkd hub serve --workers N``: N processes share one listening socket (pre-fork).

The hub is one Python process per core at most; on a multi-core host a single process
is the bottleneck of small requests (manifest GETs). The parent applies the migrations
and creates the first admin once, binds the socket, forks the workers (each its own
event loop, database pool, caches and batched pull counter: the hub is stateless
between requests), forwards SIGTERM/SIGINT to them and waits. The background sweeps
(retention rules, auto-compaction) would run in every worker, so they are refused with
several workers: run `forkd hub gc --retention` from a timer instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import uvicorn

from forkd.errors import InvalidInput
from forkd.hub.app import bootstrap_admin, create_app
from forkd.hub.secrets import claim_blob_storage
from forkd.hub.services import Hub
from forkd.hub.settings import HubSettings

MAX_WORKERS = 64


def check(settings: HubSettings, workers: int) -> None:
    if not 1 <= workers <= MAX_WORKERS:
        raise InvalidInput(f"--workers {workers}: use 1 to {MAX_WORKERS}")
    if workers > 1 and (settings.retention or settings.compact_deeper_than):
        raise InvalidInput(
            "--workers > 1 with retention rules or compact_deeper_than would run the sweeps "
            "in every worker; serve with one worker, or drop them from the config and run "
            "`forkd hub gc --retention --config FILE` from a timer"
        )


def server_config(settings: HubSettings) -> uvicorn.Config:
    """How uvicorn runs the hub app (one process).

    The event loop is asyncio's, not uvloop: libuv accepts one connection per loop
    iteration (libuv PR #3696), so while a worker is busy new clients wait behind every
    request in flight, measured at up to 5 s for the last of 200 clients connecting at
    once. asyncio accepts the whole backlog per wake-up; its request throughput here was
    the same (httptools still parses HTTP).
    """
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="asyncio",
        # X-Forwarded-For is the app's to judge, against trusted_proxies (auth.client_ip).
        proxy_headers=False,
        log_level="info",
        access_log=False,
        lifespan="on",
    )


async def _prepare(settings: HubSettings) -> None:
    hub = Hub.build(settings)
    try:
        if settings.migrate_on_start:
            await hub.db.migrate()
        await claim_blob_storage(hub.db, settings, hub.blobs)
        await bootstrap_admin(hub)
    finally:
        await hub.close()


def prepare(settings: HubSettings) -> None:
    """Before serving, once: migrations, the checks that refuse a misconfigured start
    (InvalidInput, reported by the CLI without a traceback), the first admin."""
    asyncio.run(_prepare(settings))


def serve(settings: HubSettings, workers: int) -> None:
    """Serve with ``workers`` processes until SIGTERM/SIGINT; blocks."""
    check(settings, workers)
    prepare(settings)
    sock = socket.create_server((settings.host, settings.port), backlog=2048)
    # Accepted sockets inherit this. asyncio sets it only on sockets created with
    # proto=IPPROTO_TCP, which create_server's are not; without it a response written in
    # two pieces waits for the client's delayed ACK (40 ms per small blob GET).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pids: list[int] = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # a worker: its own app, event loop and connections
            code = 0
            try:
                uvicorn.Server(server_config(settings)).run(sockets=[sock])
            except BaseException:
                code = 1
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    sock.close()
    print(f"forkd hub: {workers} workers on {settings.host}:{settings.port}", file=sys.stderr)

    def stop(signum: int, _frame: object) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
