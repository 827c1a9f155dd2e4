"""The first TLS record of a raw tunnel: is it a ClientHello, and which server does it name?

A tunnel (``CONNECT`` to an allowed destination no secret is bound to) relays the guest's
TLS end to end, but the server a CDN or a shared address routes to is the one the
ClientHello's ``server_name`` (SNI) names, not the CONNECT host. The proxy reads the
guest's first TLS record, parses it here and lets it through only if it names the
CONNECT host (``require_server``); the bytes are then forwarded unchanged.

The parser is strict and bounds-checked: every length is checked against what encloses
it, and anything but a well-formed ClientHello (RFC 8446 4.1.2, RFC 6066 3) whole in
one record of at most 2^14 bytes is refused with ``BadHello`` (its text says why). It
never raises anything else. Refused as well, since the upstream might read them
otherwise than the proxy does: an extension twice, a ``server_name`` list with more
than one entry or an entry that is not a ``host_name``, a name that is empty or not
printable ASCII, bytes after the ClientHello in its record.

A ClientHello is not only the first record: after a HelloRetryRequest (RFC 8446 4.1.4)
the client sends a second one, which may name another server. Until the upstream has
answered with a ServerHello that is not a HelloRetryRequest (``server_answer``), the
proxy reads both directions record by record (``RecordReader``) and checks every
handshake record the guest sends as a ClientHello for the CONNECT host; a second
HelloRetryRequest, or a first upstream answer that is not a whole ServerHello, is
refused (the proxy could not tell which server the guest got). After that, the bytes go
through unread.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

from forkd.engine.egress.policy import Destination

HEADER = 5  # content type (1), legacy record version (2), length (2)
MAX_FRAGMENT = 1 << 14  # RFC 8446 5.1: a record carries at most 2^14 bytes
MAX_RECORD = HEADER + MAX_FRAGMENT

HANDSHAKE = 0x16
CLIENT_HELLO = 0x01
SERVER_NAME = 0x0000
HOST_NAME = 0x00
ENCRYPTED_CLIENT_HELLO = 0xFE0D  # draft-ietf-tls-esni (ECH)
ENCRYPTED_SERVER_NAME = 0xFFCE  # ECH's predecessor (ESNI drafts)
SERVER_HELLO = 0x02
CONTENT_TYPES = frozenset({0x14, 0x15, 0x16, 0x17})  # change_cipher_spec, alert, handshake, data
MAX_CIPHERTEXT = MAX_FRAGMENT + 2048  # RFC 5246 6.2.3: the largest record on the wire
# RFC 8446 4.1.3: the ServerHello random that makes it a HelloRetryRequest
RETRY_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
ALERT_ACCESS_DENIED = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49])  # fatal alert, plaintext


class BadHello(Exception):
    """The bytes are not a ClientHello the proxy relays; ``str()`` says why."""


@dataclass(frozen=True)
class ClientHello:
    server_name: str | None  # the one host_name, lower-cased; None without server_name
    encrypted: bool  # it carries encrypted_client_hello (or ESNI): the real name is hidden


class _Cursor:
    """Bounds-checked reads over ``data[pos:end]``."""

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data, self.pos = data, pos
        self.end = len(data) if end is None else end

    @property
    def left(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise BadHello(f"the ClientHello's {what} runs past its end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def rest(self) -> bytes:
        return self.take(self.left, "bytes")

    def number(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, size: int, what: str) -> _Cursor:
        """The ``size``-byte length prefix of ``what``, then a cursor over its bytes."""
        n = self.number(size, f"{what} length")
        if n > self.left:
            raise BadHello(f"the ClientHello's {what} ({n} bytes) runs past its end")
        inner = _Cursor(self.data, self.pos, self.pos + n)
        self.pos += n
        return inner


def record_size(data: bytes) -> int | None:
    """The size (header included) of the TLS record ``data`` starts with; None until the
    5-byte header is there. BadHello if it is not a handshake record of 1 to 2^14 bytes."""
    if len(data) < HEADER:
        return None
    content_type, major, length = data[0], data[1], int.from_bytes(data[3:5], "big")
    if content_type != HANDSHAKE or major != 3:
        raise BadHello("the tunnel's first bytes are not a TLS handshake record (TLS only)")
    if not 0 < length <= MAX_FRAGMENT:
        raise BadHello(f"a TLS record of {length} bytes (1 to {MAX_FRAGMENT})")
    return HEADER + length


def parse(record: bytes) -> ClientHello:
    """Parse one whole TLS record that must hold exactly one ClientHello."""
    size = record_size(record)
    if size is None or len(record) != size:
        raise BadHello("not one whole TLS record")
    body = _Cursor(record, HEADER)
    kind = body.number(1, "handshake type")
    if kind != CLIENT_HELLO:
        raise BadHello(f"the first handshake message is not a ClientHello (type {kind})")
    length = body.number(3, "handshake length")
    if length > body.left:
        raise BadHello("a ClientHello split over several TLS records (not relayed)")
    if length < body.left:
        raise BadHello("bytes after the ClientHello in its TLS record")
    if body.number(1, "legacy version") != 3:
        raise BadHello("the ClientHello's version is not TLS")
    body.take(1 + 32, "version and random")
    if body.vector(1, "session id").left > 32:
        raise BadHello("a ClientHello session id over 32 bytes")
    suites = body.vector(2, "cipher suites")
    if suites.left == 0 or suites.left % 2:
        raise BadHello("the ClientHello's cipher suites are not a list of 2-byte codes")
    if body.vector(1, "compression methods").left == 0:
        raise BadHello("the ClientHello lists no compression method")
    if body.left == 0:
        return ClientHello(None, False)  # no extensions at all (old TLS): no server name
    extensions = body.vector(2, "extensions")
    if body.left:
        raise BadHello("bytes after the ClientHello's extensions")
    seen: set[int] = set()
    name: str | None = None
    encrypted = False
    while extensions.left:
        ext = extensions.number(2, "extension type")
        data = extensions.vector(2, f"extension {ext:#06x}")
        if ext in seen:
            raise BadHello(f"the ClientHello carries extension {ext:#06x} twice")
        seen.add(ext)
        if ext == SERVER_NAME:
            name = _server_name(data)
        elif ext in (ENCRYPTED_CLIENT_HELLO, ENCRYPTED_SERVER_NAME):
            encrypted = True
    return ClientHello(name, encrypted)


def _server_name(ext: _Cursor) -> str:
    names = ext.vector(2, "server name list")
    if ext.left:
        raise BadHello("bytes after the ClientHello's server name list")
    if names.left == 0:
        raise BadHello("an empty server name list")
    kind = names.number(1, "server name type")
    if kind != HOST_NAME:
        raise BadHello(f"a server name of type {kind} (only host_name is relayed)")
    raw = names.vector(2, "server name").rest()
    if names.left:
        raise BadHello("more than one server name in the ClientHello")
    if not raw or not all(0x21 <= b <= 0x7E for b in raw):
        raise BadHello("a server name that is empty or not printable ASCII")
    return raw.decode("ascii").lower()


def require_server(hello: ClientHello, dest: Destination) -> None:
    """BadHello unless ``hello`` may open a tunnel to ``dest``, the CONNECT destination.

    For a name: the ClientHello names exactly that host (ASCII case aside; a trailing
    dot is another name), and carries no encrypted ClientHello (whose inner name the
    proxy cannot see). For an IP literal (allowed only by an entry that is that
    literal): no server name (TLS clients send none for an address), or that address
    written out; a host name would pick one of the names served at that address.
    """
    if hello.encrypted:
        raise BadHello("an encrypted ClientHello (ECH) hides the server it names")
    if dest.kind == "ip":
        if hello.server_name is None or _same_address(hello.server_name, dest.host):
            return
        shown = hello.server_name[:80]
        raise BadHello(f"the ClientHello names {shown!r}; this tunnel is for the address {dest}")
    if hello.server_name is None:
        raise BadHello(f"the ClientHello names no server (SNI); this tunnel is for {dest.host}")
    if hello.server_name != dest.host:
        shown = hello.server_name[:80]
        raise BadHello(f"the ClientHello names {shown!r}; this tunnel is for {dest.host}")


def _same_address(name: str, address: str) -> bool:
    try:
        return ipaddress.ip_address(name) == ipaddress.ip_address(address)
    except ValueError:
        return False


def server_answer(record: bytes) -> bool:
    """True if the upstream's handshake ``record`` is a HelloRetryRequest, False for
    another ServerHello; BadHello for anything else (a fragment of one included: the
    proxy could not tell whether the guest may send another ClientHello)."""
    body = _Cursor(record, HEADER)
    if body.number(1, "upstream's handshake type") != SERVER_HELLO:
        raise BadHello("the upstream's first handshake message is not a ServerHello")
    body.take(3 + 2, "upstream's ServerHello length and version")
    return body.take(32, "upstream's ServerHello random") == RETRY_RANDOM


class RecordReader:
    """TLS records, one at a time, from a stream (``pending``: bytes already read from it).

    ``who`` names the side in BadHello's text: a record that is not TLS (content type,
    version, a length over ``MAX_CIPHERTEXT``) or a close in the middle of one."""

    def __init__(self, reader: asyncio.StreamReader, who: str, pending: bytes = b"") -> None:
        self.reader, self.who, self.pending = reader, who, pending

    async def _exactly(self, n: int) -> bytes:
        if len(self.pending) < n:
            self.pending += await self.reader.readexactly(n - len(self.pending))
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    async def next(self) -> bytes | None:
        """The next whole record; None if the stream ends between records."""
        try:
            head = await self._exactly(HEADER)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial and not self.pending:
                return None
            raise BadHello(f"{self.who} closed in the middle of a TLS record") from None
        length = int.from_bytes(head[3:5], "big")
        if head[0] not in CONTENT_TYPES or head[1] != 3 or length > MAX_CIPHERTEXT:
            raise BadHello(f"{self.who} sent bytes that are not a TLS record during the handshake")
        try:
            return head + await self._exactly(length)
        except asyncio.IncompleteReadError:
            raise BadHello(f"{self.who} closed in the middle of a TLS record") from None
