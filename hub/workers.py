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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from forkd.errors import InvalidInput
from forkd.hub.app import bootstrap_admin, create_app
from forkd.hub.secrets import claim_blob_storage
from forkd.hub.services import Hub, limited_address
from forkd.hub.settings import CLIENT_PARTS, HubSettings
from forkd.shares import Shares

MAX_WORKERS = 64
# A request's head (request line and headers): at most this many bytes, headers and
# seconds. uvicorn (httptools) bounds none of them: one connection could make the hub
# buffer a 16 MiB header, or 200 000 of them, or hold its place sending a byte a minute.
HEAD_MAX_BYTES = 1 << 20  # nginx takes 32 KiB by default; a bearer token is ~2 KiB
HEAD_MAX_HEADERS = 256
HEAD_TIMEOUT_S = 60.0  # nginx's client_header_timeout
# A request body's client silent this long (while the hub waits for it, reading not
# paused by the hub itself) closes the connection: nginx's client_body_timeout. Without
# it a body sent a byte a minute held a connection and a request for weeks.
BODY_IDLE_TIMEOUT_S = 60.0
# An answer its client reads none of for this long (the hub's writes paused the whole
# time: what it sent fills the socket's buffers) ends the connection: nginx's
# send_timeout. Without it a client that asked for a blob and read nothing held its
# connection, its request and the answer's bytes in flight for as long as it liked.
SEND_STALL_TIMEOUT_S = 60.0
# Bytes of request heads being received, summed over the connections of a worker: one
# client (a peer address; IPv6 by its /64) at most 1/8 of it (CLIENT_PARTS). Each head
# is bounded on its own (HEAD_MAX_BYTES), but one client that opened connections and
# sent each most of a 1 MiB head had the hub buffer 1 MiB per connection: gigabytes for
# thousands. Past its part, or the whole, a connection is answered 503 and closed. Heads
# of real clients are a few KiB and take milliseconds: 8 MiB is thousands at once.
HEADS = Shares(64 << 20, CLIENT_PARTS)


class _HeadTooLarge(Exception):
    pass


class BoundedHead(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) with each request's head bounded: past
    ``HEAD_MAX_BYTES`` or ``HEAD_MAX_HEADERS`` the client gets 431 and the connection is
    closed; a head not complete ``HEAD_TIMEOUT_S`` after the connection opened or the
    previous response ended closes the connection (never while a response is sent), and
    so does a body whose client is silent for ``BODY_IDLE_TIMEOUT_S``, and an answer whose
    client takes none of it for ``SEND_STALL_TIMEOUT_S``. A
    head's bytes are counted as they arrive, so one endless header is refused too
    (httptools buffers a header whole before handing it on). Counted generously: a read
    that ends one request's body and begins the next one's head counts whole (a read is
    at most 256 KiB)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._head_bytes = 0
        self._peer = limited_address(self.client[0]) if self.client else "unknown"
        self._heads = HEADS  # this connection gives back to the budget it took from
        self._headers = 0
        self._too_large = False
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()
        self._in_body = False
        self._body_at = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        """The client stopped taking the answer: it has ``SEND_STALL_TIMEOUT_S`` to take
        some of it (``resume_writing``) before the connection ends."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(SEND_STALL_TIMEOUT_S, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send_timer()

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        self._send_timer = None
        if self.flow.write_paused and not self.transport.is_closing():
            self.logger.info("closed a connection whose client read none of its answer "
                             "for %ss", SEND_STALL_TIMEOUT_S)
            self.transport.abort()  # its unsent bytes dropped, not flushed to nobody

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        answering = self.cycle is not None and not self.cycle.response_complete
        if self._in_head and not answering and not self.transport.is_closing():
            self.logger.info("closed a connection whose request head took over %ss", HEAD_TIMEOUT_S)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._give_head()
        self._disarm_head_timer()
        self._disarm_send_timer()
        self._end_body()
        super().connection_lost(exc)

    def _end_body(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_check(self) -> None:
        """The body's client idle for ``BODY_IDLE_TIMEOUT_S``: close. Time the hub keeps
        it waiting does not count (reading paused because the app has not taken what
        arrived, or a ``100 Continue`` not sent yet)."""
        self._body_timer = None
        if not self._in_body or self.transport.is_closing():
            return
        now = self.loop.time()
        held = self.flow.read_paused or (
            self.cycle is not None and self.cycle.waiting_for_100_continue
        )
        if held:
            self._body_at = now
        idle = now - self._body_at
        if idle >= BODY_IDLE_TIMEOUT_S:
            self.logger.info("closed a connection whose request body stalled %ss", idle)
            self._end_body()
            self.transport.close()
            return
        self._body_timer = self.loop.call_later(BODY_IDLE_TIMEOUT_S - idle, self._body_check)

    def _give_head(self) -> None:
        """Give back what this connection's head took of ``HEADS`` (it ended, or the
        connection did)."""
        self._heads.give(self._head_bytes, self._peer)
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._too_large:
            return
        if self._in_head and self.parser is not None:
            # Counted before httptools buffers it: one connection's head, and all of them.
            if self._heads.take_or_refuse(len(data), self._peer) is not None:
                self._refuse_heads()
                return
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_MAX_BYTES:
                self._refuse_head()
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > HEAD_MAX_HEADERS:
            self._too_large = True
            raise _HeadTooLarge  # httptools stops parsing: ``send_400_response`` follows
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._give_head()
        self._disarm_head_timer()
        super().on_headers_complete()
        self._in_body = True  # until on_message_complete (at once without a body)
        self._body_at = self.loop.time()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(BODY_IDLE_TIMEOUT_S, self._body_check)

    def on_body(self, body: bytes) -> None:
        self._body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._end_body()
        self._in_head = True  # the next request's head, if the connection is kept

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # the time for the next head starts now
            self._disarm_head_timer()
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def _refuse_head(self) -> None:
        self._refuse(
            b"431 Request Header Fields Too Large",
            f"request head too large: at most {HEAD_MAX_BYTES} bytes and "
            f"{HEAD_MAX_HEADERS} header fields; send fewer or shorter headers",
        )

    def _refuse_heads(self) -> None:
        self._refuse(
            b"503 Service Unavailable",
            f"this client ({self._peer}), or all clients together, are sending as many "
            f"bytes of request heads at once as the hub takes ({self._heads.share} for one, "
            f"{self._heads.total} in all, workers.HEADS): finish the requests begun first",
        )

    def _refuse(self, status: bytes, detail: str) -> None:
        """Answer ``status`` with ``detail`` and close: the head is not read further."""
        self._too_large = True
        self._disarm_head_timer()
        self._give_head()
        if self.transport.is_closing():
            return
        msg = detail.encode()
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(msg)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + msg
        )
        self.transport.close()


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
        http=BoundedHead,  # the request head bounded (size, header count, time)
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
