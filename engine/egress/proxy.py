"""The egress proxy a guest talks to: an HTTP/1.1 forward proxy that allows by destination.

A guest reaches the outside only through this proxy (``HTTPS_PROXY``/``HTTP_PROXY``):

- ``CONNECT host:port``: the CONNECT authority is the destination decided on. An allowed
  destination that no secret is bound to is a tunnel: the guest's first TLS record must
  be a ClientHello whose server name (SNI) is the CONNECT host (clienthello.py; no
  encrypted ClientHello, no other protocol), and is then relayed as raw bytes (the
  guest's TLS goes end to end). An allowed destination bound to a secret is
  TLS-terminated: the proxy answers the guest with a certificate for that host signed by
  the egress CA (ca.py), speaks HTTP/1.1 to the guest, swaps each bound secret's
  placeholder for its value in the authentication headers (AUTH_HEADERS), forwards over
  a new TLS connection that verifies the upstream's certificate (system store, or the
  trust given) and swaps the value back to the placeholder in the response's head (its
  reason phrase, header names and values, a 1xx's too, in any case) and body (in its
  exact case; a body with a Content-Encoding is refused: 502).
- ``GET http://host[:port]/…`` (absolute URI, plain HTTP): allowed destinations get one
  request per connection (``Connection: close``); no secret is ever put into plain HTTP.
- Anything else is refused: a tunnel whose first record is not a ClientHello naming the
  CONNECT host (a TLS alert, then the close; the upstream gets no byte), 403 for a
  destination outside the policy, 400 for a malformed or origin-form request, 421 when
  a terminated request's Host is not the CONNECT host, 502 when the upstream cannot be
  reached or a secret-bearing reply has a Content-Encoding, 503 when the connection
  limit is reached. Every decision (allowed, denied, failed) is written to the audit log
  (forkd.audit) with the child id.

DNS: only a destination already allowed is resolved, by the host's resolver (or the
``hosts`` pins the caller gives); an address a resolved name gives that is loopback,
link-local (e.g. cloud metadata, 169.254.169.254), unspecified, multicast or any other
address that is not global, or that is one of this host's own (a public address on its
interface reaches the host's own services), is not used. The guest itself needs no DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import ipaddress
import json
import re
import socket
import ssl
import struct
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvloop

from forkd.addresses import public_enough, this_host
from forkd.audit import AuditLog, BoundedAudit
from forkd.engine.egress import clienthello, http1
from forkd.engine.egress.ca import EgressCA
from forkd.engine.egress.http1 import END, Head, MessageReader, ProtocolError
from forkd.engine.egress.policy import Destination, EgressPolicy, parse_destination
from forkd.engine.egress.secrets import Secret
from forkd.errors import ForkdError, InvalidInput

CHUNK = 256 << 10  # per read and per write: fewer trips through the parser, TLS and the loop
HOP_BY_HOP = {
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authorization",
    b"proxy-authenticate",
    b"te",
    b"trailer",
    b"upgrade",
}
# The request headers a bound secret's placeholder is swapped in (OpenAI and most APIs'
# Authorization, Anthropic's x-api-key, Azure OpenAI's api-key, Google's x-goog-api-key);
# in any other header, the request line and the body, a placeholder is left as it is.
AUTH_HEADERS = frozenset({b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key"})
Headers = list[tuple[bytes, bytes]]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop a proxy runs on: uvloop. Its transports and its TLS are C (libuv,
    Cython); asyncio's TLS layer (sslproto) is pure Python and was the largest share of
    the proxy's CPU per terminated request (bench/egress_proxy.py prints it)."""
    return uvloop.new_event_loop()


@dataclass(frozen=True)
class ProxyLimits:
    """Bounds on what one guest can make the proxy hold (defaults documented in docs)."""

    head_bytes: int = 64 << 10  # a request or response head (line + headers)
    head_seconds: float = 30.0  # to send the first request head
    keepalive_seconds: float = 120.0  # between requests on a terminated connection
    read_seconds: float = 600.0  # any read during an exchange (slow model replies)
    connect_seconds: float = 10.0  # DNS + TCP + TLS to the upstream, TLS to the guest
    hello_seconds: float = 10.0  # a tunnel's first TLS record (the ClientHello)
    max_connections: int = 256  # guest connections open at once
    audit_per_minute: int = 600  # audit records per minute; the rest are counted


class Refused(ForkdError):
    """A request the proxy answers with an error status (and audits)."""

    def __init__(self, status: int, why: str, result: str = "denied") -> None:
        super().__init__(why)
        self.status = status
        self.result = result


class StreamReplacer:
    """Replace every ``old`` by ``new`` in a byte stream fed in pieces."""

    def __init__(self, old: bytes, new: bytes) -> None:
        self.old, self.new = old, new
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        keep = len(self.old) - 1
        if self._pending == b"" and len(data) > keep and self.old not in data:
            # the common case (no secret in this piece): one scan, one copy
            cut = len(data) - keep
            if self.old[:1] not in data[cut:]:
                return data  # no tail can start a match either
            self._pending = data[cut:]
            return data[:cut]
        buf = self._pending + data
        out = bytearray()
        start = 0
        while (found := buf.find(self.old, start)) >= 0:
            out += buf[start:found] + self.new
            start = found + len(self.old)
        keep = min(len(buf) - start, len(self.old) - 1)
        out += buf[start : len(buf) - keep]
        self._pending = buf[len(buf) - keep :]
        return bytes(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


class _Peer:
    """One side of a relay: a message reader over an asyncio stream.

    Outgoing bytes are queued and written when the relay is about to wait for the
    network (``next_event(…, flush=other)``) or at the end of a message: a head, its
    body and the chunk end go out as one write (one TLS record) instead of three.
    """

    def __init__(
        self,
        parser: MessageReader,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.parser, self.reader, self.writer = parser, reader, writer
        self._out = bytearray()

    async def next_event(self, seconds: float, flush: _Peer | None = None) -> http1.Event | None:
        """The next event; None once the peer has closed between messages."""
        events = self.parser.events
        while not events:
            if self.parser.done:
                return None
            if flush is not None:
                await flush.flush()
            async with asyncio.timeout(seconds):  # no task per read, as wait_for makes
                data = await self.reader.read(CHUNK)
            if data:
                self.parser.feed(data)
            else:
                self.parser.feed_eof()
        return events.popleft()

    async def queue(self, data: bytes) -> None:
        self._out += data
        if len(self._out) >= CHUNK:
            await self.flush()

    async def flush(self) -> None:
        if self._out:
            self.writer.write(bytes(self._out))
            self._out.clear()
            await self.writer.drain()

    async def send(self, data: bytes) -> None:
        await self.queue(data)
        await self.flush()


def _forwarded(headers: Iterable[tuple[bytes, bytes]], drop: set[bytes]) -> Headers:
    skip = HOP_BY_HOP | drop  # once per message, not once per header
    return [(k, v) for k, v in headers if k.lower() not in skip]


class EgressProxy:
    """One child's proxy: its policy, the secrets it may use, where decisions are audited.

    ``upstream_trust`` verifies terminated upstreams (default: the system store);
    ``hosts`` pins names to addresses (operator configuration, trusted as given).
    """

    def __init__(
        self,
        policy: EgressPolicy,
        secrets: Sequence[Secret] = (),
        audit: AuditLog | None = None,
        ca: EgressCA | None = None,
        child_id: str = "-",
        upstream_trust: ssl.SSLContext | None = None,
        hosts: Mapping[str, str] | None = None,
        limits: ProxyLimits | None = None,
    ) -> None:
        self.policy = policy
        self.audit = audit
        self.ca = ca
        self.child_id = child_id
        self.limits = limits or ProxyLimits()
        self.hosts = {k.lower(): _pinned_address(k, v) for k, v in (hosts or {}).items()}
        self._audit = BoundedAudit(audit, self.limits.audit_per_minute, "egress.suppressed",
                                   child_id, child=child_id) if audit is not None else None
        self._open = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._bound: dict[Destination, list[Secret]] = {}
        self.set_secrets(secrets)
        self.upstream_trust = upstream_trust or _default_trust()

    def set_secrets(self, secrets: Sequence[Secret], ca: EgressCA | None = None) -> None:
        """Use these secrets from the next connection on (a rotated value, a new binding);
        connections already open keep the ones they started with."""
        bound: dict[Destination, list[Secret]] = {}
        for secret in secrets:
            for binding in secret.bindings:
                if self.policy.allowing(binding) is not None:
                    bound.setdefault(binding, []).append(secret)
        self.ca = ca or self.ca
        if bound and self.ca is None:
            raise InvalidInput("secrets are bound to allowed destinations: give the egress CA")
        self._bound = bound

    def _reader(self, response: bool) -> MessageReader:
        return MessageReader(response, self.limits.head_bytes)

    # -- serving -----------------------------------------------------------------------

    async def serve(self, sock: socket.socket) -> asyncio.Server:
        """Serve guests on the listening socket ``sock`` (e.g. made inside a netns)."""
        return await asyncio.start_server(self._handle, sock=sock, limit=CHUNK)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
        return await asyncio.start_server(self._handle, host, port, limit=CHUNK)

    async def serve_refusals(self, sock: socket.socket) -> asyncio.Server:
        """Refuse (reset) and audit every connection on ``sock``: the guest's TCP that did
        not go through the proxy, redirected here by its namespace; the record names the
        destination it was for (SO_ORIGINAL_DST)."""
        return await asyncio.start_server(self._refuse_direct, sock=sock)

    async def _refuse_direct(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raw = writer.get_extra_info("socket")
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) else "-"
        target = _original_destination(raw) if raw is not None else "-"
        self._record(ip, "egress.direct", target, "denied",
                     reason="a connection that did not go through the proxy (HTTPS_PROXY)")
        if raw is not None:
            with contextlib.suppress(OSError):  # close with a reset: "connection refused"
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def aclose(self) -> None:
        """Drop every open guest connection (close the server first: no new ones)."""
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._handle_guest(reader, writer)
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)

    async def _handle_guest(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        _no_delay(writer)
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) else "-"
        guest = _Peer(self._reader(response=False), reader, writer)
        self._open += 1
        try:
            if self._open > self.limits.max_connections:
                await self._refuse(guest, ip, "egress", "-", Refused(503, "too many connections"))
                return
            await self._first_request(guest, ip)
        except (OSError, EOFError, TimeoutError, ProtocolError, ssl.SSLError):
            pass  # the guest or the upstream went away or broke the protocol: drop it
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _first_request(self, guest: _Peer, ip: str) -> None:
        try:
            event = await guest.next_event(self.limits.head_seconds)
        except ProtocolError as exc:
            await self._refuse(guest, ip, "egress", "-", Refused(exc.status, str(exc)))
            return
        if not isinstance(event, Head):
            return
        if event.method == b"CONNECT":
            await self._connect(guest, ip, event)
        else:
            await self._plain(guest, ip, event)

    # -- decisions ---------------------------------------------------------------------

    def _decide(self, authority: str, default_port: int | None) -> Destination:
        try:
            dest = parse_destination(authority, default_port=default_port, wildcard_ok=False)
        except InvalidInput as exc:
            raise Refused(400, str(exc)) from None
        if self.policy.allowing(dest) is None:
            raise Refused(403, f"{dest} is not in this child's egress policy")
        return dest

    def _record(self, ip: str, action: str, target: str, result: str, **detail: Any) -> None:
        """Audit one decision, at most ``audit_per_minute`` a minute: a guest that floods
        the proxy gets one ``egress.suppressed`` record with the count per minute after."""
        if self._audit is not None:
            self._audit.record(self.child_id, ip, action, target, result, **detail)

    async def _refuse(
        self, guest: _Peer, ip: str, action: str, target: str, refused: Refused
    ) -> None:
        self._record(ip, action, target, refused.result, status=refused.status, reason=str(refused))
        body = f"forkd egress: {refused}\n".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = HTTPStatus(refused.status).phrase.encode()
        await guest.send(http1.response_head(refused.status, reason, headers) + body)
        await _linger(guest, self.limits.head_bytes)

    # -- CONNECT -----------------------------------------------------------------------

    async def _connect(self, guest: _Peer, ip: str, request: Head) -> None:
        authority = request.target.decode("ascii", "replace")
        try:
            dest = self._decide(authority, default_port=None)
            secrets = self._bound.get(dest, [])
            upstream = await self._open_upstream(dest, tls=bool(secrets))
        except Refused as refused:
            await self._refuse(guest, ip, "egress.connect", authority, refused)
            return
        up_reader, up_writer = upstream
        _no_delay(up_writer)
        self._writers.add(up_writer)
        try:
            await guest.send(http1.response_head(200, b"Connection Established", []))
            early = guest.parser.early
            if secrets:
                names = [s.name for s in secrets]
                self._record(ip, "egress.connect", str(dest), "ok", tls="terminated",
                             secrets=names)
                if early:
                    return  # the guest spoke before the tunnel was up: not TLS we can answer
                await self._terminate(guest, ip, dest, secrets, up_reader, up_writer)
                return
            try:
                first = await self._client_hello(guest, dest, early)
            except clienthello.BadHello as exc:
                self._record(ip, "egress.connect", str(dest), "denied", tls="tunnel",
                             secrets=[], reason=str(exc))
                return
            self._record(ip, "egress.connect", str(dest), "ok", tls="tunnel", secrets=[])
            up_writer.write(first)  # the bytes checked, unchanged
            try:
                await self._tunnel(guest, dest, up_reader, up_writer, early[len(first) :])
            except clienthello.BadHello as exc:
                self._record(ip, "egress.connect", str(dest), "denied", tls="tunnel",
                             secrets=[], reason=str(exc))
        finally:
            self._writers.discard(up_writer)
            up_writer.close()

    async def _client_hello(self, guest: _Peer, dest: Destination, early: bytes) -> bytes:
        """The guest's first TLS record in a tunnel (and any bytes that came with it in
        the CONNECT's read), once it is a ClientHello naming ``dest``; BadHello otherwise,
        after a TLS alert to the guest if it spoke TLS. Nothing is sent upstream here."""
        buf = bytearray(early)
        try:
            async with asyncio.timeout(self.limits.hello_seconds):  # for the whole record
                while True:
                    size = clienthello.record_size(bytes(buf[: clienthello.HEADER]))
                    if size is not None and len(buf) >= size:
                        break
                    # never more than the record (at most MAX_RECORD bytes) is read here
                    want = (size or clienthello.HEADER) - len(buf)
                    data = await guest.reader.read(want)
                    if not data:
                        raise clienthello.BadHello("the guest closed before a whole ClientHello")
                    buf += data
            first = bytes(buf[:size])
            clienthello.require_server(clienthello.parse(first), dest)
        except TimeoutError:
            why = f"no whole ClientHello within {self.limits.hello_seconds:g} s"
            raise clienthello.BadHello(why) from None
        except clienthello.BadHello:
            with contextlib.suppress(OSError, RuntimeError):
                if buf[:1] == bytes([clienthello.HANDSHAKE]):
                    await guest.send(clienthello.ALERT_ACCESS_DENIED)
                await _linger(guest, clienthello.MAX_RECORD)  # no reset before it is read
            raise
        return first  # what came after it in ``early`` is read as the next records

    async def _tunnel(
        self,
        guest: _Peer,
        dest: Destination,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        pending: bytes,
    ) -> None:
        """Relay a tunnel whose first ClientHello passed. Until the upstream answers with
        a ServerHello that is not a HelloRetryRequest, both sides are read record by
        record and every handshake record of the guest must be a ClientHello naming
        ``dest`` (a second ClientHello, after a retry, could name another server); then
        the bytes go through unread. BadHello (after a TLS alert to the guest, the
        upstream getting nothing of the refused record) for what breaks that."""
        settled = asyncio.Event()  # set before the ServerHello is passed to the guest

        async def from_guest() -> None:
            records = clienthello.RecordReader(guest.reader, "the guest", pending)
            while not settled.is_set():
                record = await records.next()
                if record is None:
                    break
                if record[0] == clienthello.HANDSHAKE and not settled.is_set():
                    clienthello.require_server(clienthello.parse(record), dest)
                up_writer.write(record)
                await up_writer.drain()
            else:
                up_writer.write(records.pending)
                await _pipe(guest.reader, up_writer)
                return
            with contextlib.suppress(OSError, RuntimeError):
                if up_writer.can_write_eof():
                    up_writer.write_eof()

        async def from_upstream() -> None:
            records = clienthello.RecordReader(up_reader, "the upstream")
            retried = False
            while not settled.is_set():
                record = await records.next()
                if record is None:
                    with contextlib.suppress(OSError, RuntimeError):
                        if guest.writer.can_write_eof():
                            guest.writer.write_eof()
                    return
                if record[0] == clienthello.HANDSHAKE:
                    if not clienthello.server_answer(record):
                        settled.set()
                    elif retried:
                        raise clienthello.BadHello("the upstream asked for a ClientHello again")
                    else:
                        retried = True
                guest.writer.write(record)
                await guest.writer.drain()
            guest.writer.write(records.pending)
            await _pipe(up_reader, guest.writer)

        tasks = [asyncio.ensure_future(from_guest()), asyncio.ensure_future(from_upstream())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failures = [task.exception() for task in done if task.exception() is not None]
            for failure in failures:  # else the side that broke (reset, closed) ends both
                if isinstance(failure, clienthello.BadHello):
                    with contextlib.suppress(OSError, RuntimeError):
                        await guest.send(clienthello.ALERT_ACCESS_DENIED)
                        await _linger(guest, clienthello.MAX_CIPHERTEXT)
                    raise failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _open_upstream(
        self, dest: Destination, tls: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        address = await self._resolve(dest)
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(
                    address,
                    dest.port,
                    ssl=self.upstream_trust if tls else None,
                    server_hostname=dest.host if tls else None,
                    limit=CHUNK,
                ),
                self.limits.connect_seconds,
            )
        except ssl.SSLCertVerificationError as exc:
            why = f"{dest}: the upstream's certificate is refused: {exc.verify_message}"
            raise Refused(502, why, "failed") from None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            why = f"{dest}: cannot reach the upstream: {exc or 'timed out'}"
            raise Refused(502, why, "failed") from None

    async def _resolve(self, dest: Destination) -> str:
        if dest.kind == "ip":
            return dest.host
        pinned = self.hosts.get(dest.host)
        if pinned is not None:
            return pinned
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(dest.host, dest.port, type=socket.SOCK_STREAM),
                self.limits.connect_seconds,
            )
        except (OSError, TimeoutError) as exc:
            why = f"{dest.host}: cannot resolve: {exc or 'timed out'}"
            raise Refused(502, why, "failed") from None
        for *_, sockaddr in infos:
            if _usable_for_a_name(str(sockaddr[0])):
                return str(sockaddr[0])
        raise Refused(
            502,
            f"{dest.host} resolves only to addresses that are not global (loopback, "
            "link-local, private, shared, reserved, multicast, a cloud host's own services) "
            "or that are this host's own, which egress never uses for a name (pin it, or "
            "allow the IP literal instead)",
            "failed",
        )

    # -- TLS termination for secret-bearing destinations ----------------------------------

    async def _terminate(
        self,
        guest: _Peer,
        ip: str,
        dest: Destination,
        secrets: list[Secret],
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        assert self.ca is not None
        ctx = self.ca.leaf_context(dest.host)
        await guest.writer.start_tls(ctx, ssl_handshake_timeout=self.limits.connect_seconds)
        inner = _Peer(self._reader(response=False), guest.reader, guest.writer)
        upstream = _Peer(self._reader(response=True), up_reader, up_writer)
        wait = self.limits.keepalive_seconds
        while True:
            try:
                event = await inner.next_event(wait)
            except ProtocolError as exc:
                broken = Refused(exc.status, str(exc))
                await self._refuse(inner, ip, "egress.request", str(dest), broken)
                return
            if not isinstance(event, Head):
                return
            try:
                target = _origin_target(event, dest)
            except Refused as refused:
                await self._refuse(inner, ip, "egress.request", str(dest), refused)
                return
            # exactly one Host, the checked one: a second Host could route elsewhere
            headers = _forwarded(event.headers, {b"accept-encoding", b"host", b"connection"})
            headers = [
                (k, _swap_in(v, secrets) if k.lower() in AUTH_HEADERS else v) for k, v in headers
            ]
            headers.insert(0, (b"host", _authority(dest, 443)))
            headers.append((b"accept-encoding", b"identity"))  # keep replies greppable
            if not _guest_keeps(event):
                headers.append((b"connection", b"close"))
            try:
                await self._relay_request(inner, upstream, event, target, headers)
            except ProtocolError as exc:  # the guest's body broke the framing
                broken = Refused(exc.status, str(exc))
                await self._refuse(inner, ip, "egress.request", str(dest), broken)
                return
            try:
                if not await self._relay_response(upstream, inner, event, secrets):
                    return
            except Refused as refused:  # nothing of this response reached the guest
                # what it says of the reply is scrubbed as the reply would have been
                said = _scrub(str(refused).encode(), _spellings(secrets))
                refused = Refused(refused.status, said.decode(errors="replace"), refused.result)
                await self._refuse(inner, ip, "egress.request", str(dest), refused)
                return

    async def _relay_request(
        self, guest: _Peer, upstream: _Peer, request: Head, target: bytes, headers: Headers
    ) -> None:
        """Send the request head and body upstream, in the framing the guest gave (the
        body is not changed: Content-Length stays true)."""
        upstream.parser.no_body_next = request.method == b"HEAD"
        await upstream.queue(http1.request_head(request.method, target, headers))
        await self._relay_body(guest, upstream, None, request.chunked, hold=_small_body(request))

    async def _relay_body(
        self,
        source: _Peer,
        sink: _Peer,
        replacers: list[StreamReplacer] | None,
        chunked: bool,
        hold: bool = False,
    ) -> None:
        """Copy one message body from ``source`` to ``sink`` (through ``replacers``),
        chunked or as it is. hold: the body is small and nobody waits for the head alone,
        so head and body go out as one write when the body is complete (not head first
        while the body arrives)."""
        while True:
            event = await source.next_event(self.limits.read_seconds, flush=None if hold else sink)
            if isinstance(event, bytes):
                data = _feed(replacers, event) if replacers else event
                if data:
                    await sink.queue(http1.chunk(data) if chunked else data)
            elif event is END:
                rest = _flush(replacers) if replacers else b""
                if rest:
                    await sink.queue(http1.chunk(rest) if chunked else rest)
                await sink.send(http1.LAST_CHUNK if chunked else b"")
                return
            else:
                raise EOFError("the peer closed the connection in the middle of a message")

    async def _response_head(
        self, upstream: _Peer, guest: _Peer, scrub: list[tuple[bytes, bytes]]
    ) -> Head:
        """The upstream's response head; 1xx responses before it go to the guest. Refused
        (502, audited ``failed``) when the upstream's head breaks HTTP/1.1: nothing of it
        reaches the guest, which is told so rather than finding its connection dropped."""
        while True:
            try:
                event = await upstream.next_event(self.limits.read_seconds)
            except ProtocolError as exc:
                raise Refused(
                    502,
                    f"the upstream's answer broke HTTP/1.1 ({exc}); nothing of it was passed on",
                    "failed",
                ) from exc
            if isinstance(event, Head) and event.status >= 200:
                return event
            if isinstance(event, Head):
                await guest.send(_scrub(
                    http1.response_head(event.status, event.reason, event.headers), scrub))
            elif event is not END:  # END: the end of a 1xx
                raise EOFError("the upstream closed the connection before answering")

    async def _relay_response(
        self,
        upstream: _Peer,
        guest: _Peer,
        request: Head,
        secrets: list[Secret],
        close: bool = False,
    ) -> bool:
        """Relay one response; True if both connections may carry the next request.

        The body may change length when a secret is swapped back to its placeholder:
        the upstream's framing is dropped and the guest gets it chunked (HTTP/1.1) or
        delimited by the close (HTTP/1.0). With secrets, Refused (502) for a body whose
        Content-Encoding is not identity (scrubbing would not see the value in it);
        nothing of that response is sent then."""
        scrub = _spellings(secrets)
        head = await self._response_head(upstream, guest, scrub)
        body = head.has_body and request.method != b"HEAD"
        if secrets and body and _content_coding(head) is not None:
            # quoted as it came, scrubbed, then cut: the upstream chose it after the value
            # was sent (an echo of the guest's headers), and lower-cased or cut first a
            # spelling of the value would no longer be found in it
            coding = _scrub(b", ".join(v for k, v in head.headers
                                       if k.lower() == b"content-encoding"), scrub)
            raise Refused(
                502,
                f"the upstream answered with Content-Encoding "
                f"{coding[:40].decode('ascii', 'replace')!r}, which the proxy cannot scrub "
                "of the secret (it asks for identity)",
                "failed",
            )
        headers = _forwarded(head.headers, {b"content-length", b"transfer-encoding", b"connection"})
        keep = not close and head.keep_alive and _guest_keeps(request)
        chunked = body and request.version == "1.1"
        if chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        elif body:
            keep = False  # an HTTP/1.0 guest: the body ends when the proxy closes
        if not keep:
            headers.append((b"connection", b"close"))
        await guest.queue(_scrub(http1.response_head(head.status, head.reason, headers),
                                      scrub))
        replacers = [StreamReplacer(old, new) for old, new in scrub]
        # a small body of known length (not a stream): head and body go out as one write
        hold = head.length is not None and head.length <= CHUNK
        await self._relay_body(upstream, guest, replacers or None, chunked, hold=hold)
        return keep

    # -- plain HTTP ----------------------------------------------------------------------

    async def _plain(self, guest: _Peer, ip: str, request: Head) -> None:
        target = request.target.decode("ascii", "replace")
        try:
            authority, path = _split_http_url(target)
            dest = self._decide(authority, default_port=80)
            hosts = [v for k, v in request.headers if k.lower() == b"host"]
            if len(hosts) > 1:
                raise Refused(400, "a request must carry one Host header")
            host = hosts[0] if hosts else None
            if host is not None and _host_destination(host, 80) != dest:
                raise Refused(400, f"the Host header {host[:80]!r} is not the URL's host {dest}")
            upstream_streams = await self._open_upstream(dest, tls=False)
        except Refused as refused:
            await self._refuse(guest, ip, "egress.http", target[:200], refused)
            return
        up_reader, up_writer = upstream_streams
        _no_delay(up_writer)
        self._writers.add(up_writer)
        try:
            self._record(ip, "egress.http", str(dest), "ok", method=request.method.decode())
            upstream = _Peer(self._reader(response=True), up_reader, up_writer)
            headers = _forwarded(request.headers, {b"host", b"connection"})
            headers = [(b"host", authority.encode()), *headers, (b"connection", b"close")]
            try:
                await self._relay_request(guest, upstream, request, path, headers)
            except ProtocolError as exc:  # the guest's body broke the framing
                broken = Refused(exc.status, str(exc))
                await self._refuse(guest, ip, "egress.http", str(dest), broken)
                return
            try:
                await self._relay_response(upstream, guest, request, [], close=True)
            except Refused as refused:  # nothing of this response reached the guest
                await self._refuse(guest, ip, "egress.http", str(dest), refused)
        finally:
            self._writers.discard(up_writer)
            up_writer.close()


# -- helpers -----------------------------------------------------------------------------


def _default_trust() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY: the proxy writes a head, then a body, then a chunk end; with Nagle on,
    each would wait for the peer's delayed ACK (40 ms). asyncio sets it only on sockets
    whose proto is IPPROTO_TCP, which a socket given to ``serve`` may not say."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


def _original_destination(sock: Any) -> str:
    """``ip:port`` a nat-redirected IPv4 connection was for, or ``-``."""
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return "-"
    port, addr = struct.unpack_from("!2xH4s", raw)
    return f"{socket.inet_ntoa(addr)}:{port}"


def _pinned_address(name: str, address: str) -> str:
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise InvalidInput(f"the pin for {name!r} is not an IP address: {address!r}") from None


def _usable_for_a_name(address: str) -> bool:
    """An address a resolved name may lead to: global (addresses.public_enough) and not this
    host's own (this_host: a global address on the host's interface is still the host)."""
    return public_enough(address) and not this_host(address)


def _swap_in(value: bytes, secrets: list[Secret]) -> bytes:
    """An authentication header's value with each secret's placeholder put as its value."""
    for s in secrets:
        value = value.replace(s.placeholder.encode(), s.value.encode())
    return value


def _spellings(secrets: list[Secret]) -> list[tuple[bytes, bytes]]:
    """(spelling of a value, its placeholder) for each secret, longest spelling first: the
    value as it is, JSON-escaped (``\\"`` ``\\\\``, with ``\\/``, and Go's encoding/json,
    which writes ``<`` ``>`` ``&`` as ``\\u003c`` ``\\u003e`` ``\\u0026``), percent-encoded
    (upper- and lower-case hex; a form's ``+`` for a space too) and HTML-escaped (an error
    page). A placeholder is ``[A-Za-z0-9_-]``: the same in each."""
    pairs: dict[bytes, bytes] = {}
    for s in secrets:
        for spelling in _spellings_of(s.value):
            pairs.setdefault(spelling.encode(), s.placeholder.encode())
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def _spellings_of(value: str) -> set[str]:
    json_form = json.dumps(value)[1:-1]
    go_form = json_form.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    encoded = {urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value, safe="")}
    lower = {re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), e) for e in encoded}
    return {value, json_form, json_form.replace("/", "\\/"), go_form, html.escape(value),
            *encoded, *lower}


def _scrub(value: bytes, spellings: list[tuple[bytes, bytes]]) -> bytes:
    """``value`` (a whole response head, or the proxy's words about one) with every
    spelling of a secret's value replaced by its placeholder, in any case and wherever it
    is: the reason phrase, a header's NAME as well as its value (an upstream that echoes
    the request's headers may echo them as names, and HTTP/1.1 servers lower-case names
    and often values). A placeholder is a token (``[A-Za-z0-9_-]``): a scrubbed name is
    still a name, and no CR or LF is made. (A body is scrubbed in its exact case only,
    by StreamReplacer.)"""
    if not spellings:
        return value
    placeholders = {spelling.lower(): placeholder for spelling, placeholder in spellings}
    found = re.compile(b"|".join(re.escape(spelling) for spelling, _ in spellings), re.I)
    return found.sub(lambda m: placeholders[m.group(0).lower()], value)


def _content_coding(head: Head) -> str | None:
    """The response's Content-Encoding if it is anything but identity (or none)."""
    codings = [
        c.strip().lower()
        for k, v in head.headers
        if k.lower() == b"content-encoding"
        for c in v.split(b",")
    ]
    other = [c for c in codings if c not in (b"", b"identity")]
    return b", ".join(other).decode("ascii", "replace") if other else None


def _feed(replacers: list[StreamReplacer], data: bytes) -> bytes:
    for r in replacers:
        data = r.feed(data)
    return data


def _flush(replacers: list[StreamReplacer]) -> bytes:
    data = b""
    for r in replacers:
        data = r.feed(data) + r.flush()
    return data


def _small_body(request: Head) -> bool:
    """A request whose whole body (Content-Length ≤ CHUNK) the guest sends without waiting
    for an answer (no ``Expect: 100-continue``)."""
    if request.header(b"expect") is not None:
        return False
    if request.length is None:
        return not request.chunked  # no body at all
    return request.length <= CHUNK


def _guest_keeps(request: Head) -> bool:
    """The guest may send another request on this connection after this one's answer."""
    return request.keep_alive and request.version == "1.1"


def _host_destination(host: bytes, default_port: int) -> Destination | None:
    try:
        return parse_destination(host.decode("ascii"), default_port=default_port, wildcard_ok=False)
    except (InvalidInput, UnicodeDecodeError):
        return None


def _authority(dest: Destination, default_port: int) -> bytes:
    host = f"[{dest.host}]" if ":" in dest.host else dest.host
    return (host if dest.port == default_port else f"{host}:{dest.port}").encode()


def _origin_target(request: Head, dest: Destination) -> bytes:
    """The request's origin-form target, once its authority is checked to be ``dest``."""
    target = request.target
    authority = request.header(b"host")
    if target.startswith(b"https://"):
        rest = target[len(b"https://") :]
        end = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
        authority, target = rest[:end], rest[end:] or b"/"
        if target.startswith(b"?"):
            target = b"/" + target
    if not target.startswith(b"/") and target != b"*":
        raise Refused(400, "a request in the tunnel must use an origin-form target (/path)")
    hosts = [v for k, v in request.headers if k.lower() == b"host"]
    if len(hosts) > 1:
        raise Refused(400, "a request must carry one Host header")
    # the canonical spelling of dest needs no parse (the same bytes name the same place)
    if authority is None or (
        authority != _authority(dest, 443) and _host_destination(authority, 443) != dest
    ):
        shown = authority[:80] if authority is not None else b"(none)"
        raise Refused(421, f"this connection is for {dest}; the request names {shown!r}")
    return target


def _split_http_url(target: str) -> tuple[str, bytes]:
    """(authority, origin-form path) of an absolute ``http://`` URI; Refused otherwise."""
    if target.lower().startswith("https://"):
        raise Refused(400, "use CONNECT for https:// destinations (set HTTPS_PROXY)")
    if not target.lower().startswith("http://"):
        raise Refused(400, "this is a forward proxy: send absolute http:// URIs or CONNECT")
    rest = target[len("http://") :]
    cuts = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    end = min(cuts, default=len(rest))
    authority, path = rest[:end], rest[end:].split("#", 1)[0] or "/"
    if path.startswith("?"):
        path = "/" + path
    return authority, path.encode("ascii")


async def _linger(peer: _Peer, max_bytes: int) -> None:
    """Half-close, then read (and drop) what the peer had already sent, for up to a
    second: closing with unread bytes would reset the connection and lose the answer."""
    if not peer.writer.can_write_eof():
        return
    with contextlib.suppress(OSError, TimeoutError):
        peer.writer.write_eof()
        await asyncio.wait_for(peer.reader.read(max_bytes), 1)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()

