"""Egress policy: the destinations a child may reach, as validated ``HOST[:PORT]`` entries.

Grammar of one entry (ASCII only, matched whole, the forkd.names style):

- ``HOST`` is a hostname of LDH labels (``[a-z0-9-]``, 1-63 characters, not starting or
  ending with ``-``), at most 253 characters, whose last label starts with a letter (so
  ``2130706433`` or ``0x7f.1`` can never be read as an address by a resolver); or
  ``*.`` followed by such a hostname of at least two labels (the wildcard stands for
  exactly ONE label: ``*.example.com`` allows ``api.example.com``, not ``example.com``
  nor ``a.b.example.com``); or an IPv4 literal in dotted decimal; or an IPv6 literal
  in brackets (``[2001:db8::1]:443``). Upper case letters are lowered (hostnames are
  case-insensitive); non-ASCII names are refused: write an IDNA name in its ``xn--``
  form. A trailing dot is refused.
- ``PORT`` is 1-65535 without leading zeros, default 443.

An IP literal is allowed only by an entry that is that literal: a hostname entry never
allows connecting to an address, and an address entry never allows a name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from forkd.errors import InvalidInput
from forkd.names import matches, shown, whole

DEFAULT_PORT = 443
MAX_HOSTNAME = 253
MAX_ENTRIES = 256

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_LAST_LABEL = r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?"
HOSTNAME_RE = whole(rf"(?:{_LABEL}\.)*{_LAST_LABEL}")
PORT_RE = whole(r"[1-9][0-9]{0,4}")
_IPV4_RE = whole(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")
_IPV6_RE = whole(r"[0-9a-fA-F:.]{2,45}")

Kind = Literal["name", "wildcard", "ip"]


@dataclass(frozen=True, order=True)
class Destination:
    """One validated ``HOST:PORT``. ``host`` is lower case; an IPv6 host has no brackets."""

    host: str
    port: int
    kind: Kind = "name"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        wildcard = "*." if self.kind == "wildcard" else ""
        return f"{wildcard}{host}:{self.port}"


def _bad(text: str, why: str) -> InvalidInput:
    return InvalidInput(
        f"invalid destination {shown(text)}: {why}; write HOST[:PORT], e.g. api.openai.com, "
        "*.example.com:8443, 10.0.0.5:8000 or [2001:db8::1]:443"
    )


def parse_port(text: str, whole_text: str) -> int:
    if not matches(PORT_RE, text) or int(text) > 65535:
        raise _bad(whole_text, f"port {shown(text)} is not a number from 1 to 65535")
    return int(text)


def parse_host(text: str, whole_text: str, wildcard_ok: bool) -> tuple[str, Kind]:
    """A validated host (lowered) and its kind; see the module docstring for the grammar."""
    if not isinstance(text, str) or not text.isascii():
        raise _bad(whole_text, "the host is not ASCII: write an IDNA name in its xn-- form")
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        if not matches(_IPV6_RE, inner):
            raise _bad(whole_text, "not an IPv6 address in brackets")
        try:
            return str(ipaddress.IPv6Address(inner)), "ip"
        except ValueError as exc:
            raise _bad(whole_text, "not an IPv6 address in brackets") from exc
    if matches(_IPV4_RE, text):
        try:
            return str(ipaddress.IPv4Address(text)), "ip"
        except ValueError as exc:
            raise _bad(whole_text, "not an IPv4 address in dotted decimal") from exc
    host = text.lower()
    kind: Kind = "name"
    if host.startswith("*."):
        if not wildcard_ok:
            raise _bad(whole_text, "a wildcard is not allowed here")
        host, kind = host[2:], "wildcard"
        if "." not in host:
            raise _bad(whole_text, "a wildcard needs at least two labels after '*.'")
    if len(host) > MAX_HOSTNAME or not matches(HOSTNAME_RE, host):
        raise _bad(
            whole_text,
            "the host is not a hostname (labels of a-z, 0-9 and '-', the last one "
            "starting with a letter, at most 253 characters, no trailing dot)",
        )
    return host, kind


def parse_destination(
    text: str, default_port: int | None = DEFAULT_PORT, wildcard_ok: bool = True
) -> Destination:
    """Parse ``HOST[:PORT]``; ``default_port=None`` makes the port required."""
    if not isinstance(text, str) or len(text) > MAX_HOSTNAME + 10:
        raise _bad(str(text), "too long")
    host_text, port_text = _split_authority(text)
    if port_text is None:
        if default_port is None:
            raise _bad(text, "the port is missing")
        port = default_port
    else:
        port = parse_port(port_text, text)
    host, kind = parse_host(host_text, text, wildcard_ok)
    return Destination(host, port, kind)


def _split_authority(text: str) -> tuple[str, str | None]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(text, "an IPv6 address needs a closing ']'")
        rest = text[end + 1 :]
        if not rest:
            return text, None
        if not rest.startswith(":"):
            raise _bad(text, "only ':PORT' may follow an IPv6 address")
        return text[: end + 1], rest[1:]
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, None
    if ":" in host:
        raise _bad(text, "write an IPv6 address in brackets")
    return host, port


@dataclass(frozen=True)
class EgressPolicy:
    """The destinations one child may reach; everything else is refused."""

    entries: tuple[Destination, ...] = ()

    @classmethod
    def parse(cls, texts: Iterable[str]) -> EgressPolicy:
        entries = tuple(sorted({parse_destination(t) for t in texts}))
        if len(entries) > MAX_ENTRIES:
            raise InvalidInput(
                f"an egress policy holds at most {MAX_ENTRIES} destinations, not {len(entries)}"
            )
        return cls(entries)

    def allowing(self, dest: Destination) -> Destination | None:
        """The entry that allows ``dest`` (a concrete name or address), or None."""
        if dest.kind == "wildcard":
            return None
        for entry in self.entries:
            if entry.port != dest.port:
                continue
            if entry.kind == dest.kind and entry.host == dest.host:
                return entry
            if entry.kind == "wildcard" and dest.kind == "name":
                label, _, parent = dest.host.partition(".")
                if label and parent == entry.host:
                    return entry
        return None

    def __str__(self) -> str:
        return ", ".join(str(e) for e in self.entries) or "(none: no egress)"
