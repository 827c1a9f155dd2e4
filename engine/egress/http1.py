"""HTTP/1.1 messages for the egress proxy: strict parsing (llhttp, through httptools) and
the bytes of the heads and body framing the proxy writes.

A ``MessageReader`` turns the bytes of one connection into events, in order: a ``Head``
(request or response line and headers), ``bytes`` (body data, de-chunked) and ``END``
(the message is complete). llhttp runs in its strict mode: obs-fold, bare LF, a
Content-Length next to a Transfer-Encoding, a repeated Content-Length, a sign or a comma
in one, whitespace before a header's colon, control bytes in names or values and a chunk
size that is not hex or overflows are all refused. On top of it this module refuses a
Transfer-Encoding other than exactly ``chunked``, an HTTP version other than 1.0 or 1.1,
an HTTP/1.1 request without Host, a protocol upgrade (other than CONNECT) and a head or
trailer section over ``head_bytes``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Final

import httptools

Headers = list[tuple[bytes, bytes]]


class End:
    """The event after the last body byte of a message."""

    def __repr__(self) -> str:
        return "END"


END: Final = End()


class ProtocolError(Exception):
    """The peer broke HTTP/1.1; ``status`` is what a server answers it with."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass
class Head:
    """A request head (method, target) or a response head (status, reason)."""

    headers: Headers
    version: str = "1.1"
    keep_alive: bool = True
    method: bytes = b""
    target: bytes = b""
    status: int = 0
    reason: bytes = b""
    chunked: bool = False  # the body is chunked (else Content-Length, close, or none)
    length: int | None = None  # its Content-Length (llhttp checked it: digits, one)
    has_body: bool = True  # a response that may carry a body (not 1xx, 204, 304, HEAD)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case)."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


Event = Head | bytes | End


class _HeadDone(Exception):
    """Raised from a callback to stop llhttp after a HEAD request's response head."""


@dataclass
class MessageReader:
    """Parse one direction of a connection: requests (a server's view) or responses."""

    response: bool
    head_bytes: int
    events: collections.deque[Event] = field(default_factory=collections.deque)
    early: bytes = b""  # the bytes after a CONNECT request's head (the tunnel's first)
    no_body_next: bool = False  # the next final response answers HEAD: it has no body
    done: bool = False  # stopped (CONNECT, a HEAD response or an error): feed no more

    def __post_init__(self) -> None:
        kind = httptools.HttpResponseParser if self.response else httptools.HttpRequestParser
        self._parser = kind(self)
        self._size = 0  # bytes of the current head or trailers
        self._idle = 0  # bytes fed since the last event (a head or trailers still arriving)
        self._headers: Headers = []
        self._line = bytearray()  # the request target or the response reason
        self._in_body = False
        self._until_close = False  # the current response's body ends when the peer closes

    # -- feeding -------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse ``data``; its events are appended to ``events``. Raises ProtocolError."""
        if self.done:
            raise ProtocolError(400, "bytes after the end of what this connection may carry")
        before = len(self.events)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.done = True
            last = self.events[-2] if len(self.events) >= 2 else None
            if self.response or not isinstance(last, Head) or last.method != b"CONNECT":
                why = "protocol upgrades are not relayed (only CONNECT)"
                raise ProtocolError(400, why) from None
            self.early = data[int(upgrade.args[0]) :]
        except httptools.HttpParserCallbackError as exc:
            self.done = True
            if isinstance(exc.__context__, ProtocolError):
                raise exc.__context__ from None
            if not isinstance(exc.__context__, _HeadDone):
                raise
        except httptools.HttpParserError as exc:
            self.done = True
            raise ProtocolError(400, f"malformed HTTP/1.1: {exc}") from None
        if len(self.events) > before:
            self._idle = 0
            return
        self._idle += len(data)
        if self._idle > self.head_bytes:  # httptools holds a partial header until it ends
            self.done = True
            raise ProtocolError(431, f"a head or trailers over {self.head_bytes} bytes")

    def feed_eof(self) -> None:
        """The peer closed: ends a body delimited by the close; a cut message is EOFError."""
        if self._in_body and self._until_close:
            self._in_body = False
            self.done = True
            self.events.append(END)
        elif self._in_body or self._size:
            raise EOFError("the peer closed the connection in the middle of a message")
        self.done = True

    # -- llhttp callbacks ----------------------------------------------------------------

    def _count(self, n: int) -> None:
        self._size += n
        if self._size > self.head_bytes:
            raise ProtocolError(431, f"a head or trailers over {self.head_bytes} bytes")

    def on_message_begin(self) -> None:
        self._size, self._headers, self._line = 1, [], bytearray()

    def on_url(self, piece: bytes) -> None:
        self._count(len(piece))
        self._line += piece

    def on_status(self, piece: bytes) -> None:
        self._count(len(piece))
        self._line += piece

    def on_header(self, name: bytes, value: bytes | None) -> None:
        self._count(len(name) + len(value or b"") + 4)
        if not self._in_body:  # trailers are read (and bounded) but not relayed
            self._headers.append((name, value or b""))

    def on_headers_complete(self) -> None:
        head = self._head()
        self._size = 0
        self._in_body = True
        self.events.append(head)
        if self.response and self.no_body_next and head.status >= 200:
            # llhttp cannot be told that this response has no body: stop it here, and
            # reuse no more of this connection (nothing may follow on it unasked)
            head.has_body, head.keep_alive = False, False
            self._in_body = False
            self.events.append(END)
            raise _HeadDone

    def on_body(self, data: bytes) -> None:
        self.events.append(data)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._size = 0
        self.events.append(END)

    # -- heads ---------------------------------------------------------------------------

    def _head(self) -> Head:
        parser = self._parser
        version = parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise ProtocolError(505, f"HTTP/{version} is not supported: speak HTTP/1.1")
        te = [v for k, v in self._headers if k.lower() == b"transfer-encoding"]
        if te and (len(te) > 1 or te[0].strip().lower() != b"chunked"):
            raise ProtocolError(501, "only Transfer-Encoding: chunked is supported")
        head = Head(self._headers, version, bool(parser.should_keep_alive()), chunked=bool(te))
        length = head.header(b"content-length")
        head.length = int(length) if length is not None else None
        if isinstance(parser, httptools.HttpResponseParser):
            head.status = parser.get_status_code()
            head.reason = bytes(self._line)
            head.has_body = head.status >= 200 and head.status not in (204, 304)
            self._until_close = head.has_body and not te and length is None
        elif isinstance(parser, httptools.HttpRequestParser):
            head.method = parser.get_method()
            head.target = bytes(self._line)
            if version == "1.1" and head.header(b"host") is None:
                raise ProtocolError(400, "an HTTP/1.1 request must carry a Host header")
        return head


# -- writing -----------------------------------------------------------------------------

LAST_CHUNK: Final = b"0\r\n\r\n"


def _header_lines(headers: Headers) -> bytes:
    return b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers)


def request_head(method: bytes, target: bytes, headers: Headers) -> bytes:
    return b"%s %s HTTP/1.1\r\n%s\r\n" % (method, target, _header_lines(headers))


def response_head(status: int, reason: bytes, headers: Headers) -> bytes:
    return b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason, _header_lines(headers))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
