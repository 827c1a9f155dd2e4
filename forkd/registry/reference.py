"""Remote references: ``[HUB/]NAMESPACE/NAME[:TAG]``, with the hub from FORKD_HUB by default.

A first component is a hub when it contains ``.`` or ``:`` or is ``localhost``
(the docker convention); a hub may carry an ``http://`` or ``https://``
scheme. Loopback hubs default to plain HTTP, every other hub to HTTPS.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from forkd.errors import InvalidInput
from forkd.names import DEFAULT_TAG, validate_name, validate_tag

_HOST_RE = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$|^\[[0-9a-fA-F:]+\](:[0-9]{1,5})?$")
_LOOPBACK = ("localhost", "127.", "[::1]")


@dataclass(frozen=True)
class Hub:
    host: str  # host[:port]
    scheme: str  # "http" or "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    def __str__(self) -> str:
        return self.host


@dataclass(frozen=True)
class RemoteRef:
    hub: Hub
    name: str
    tag: str

    def __str__(self) -> str:
        return f"{self.hub}/{self.name}:{self.tag}"


def parse_hub(text: str) -> Hub:
    scheme = ""
    for prefix in ("http://", "https://"):
        if text.startswith(prefix):
            scheme, text = prefix[:-3], text[len(prefix) :]
    text = text.rstrip("/")
    if not _HOST_RE.fullmatch(text) or len(text) > 255:
        raise InvalidInput(f"invalid hub address {text[:80]!r}: expected HOST[:PORT]")
    if not scheme:
        scheme = "http" if text.startswith(_LOOPBACK) else "https"
    return Hub(text, scheme)


def default_hub() -> Hub | None:
    env = os.environ.get("FORKD_HUB")
    return parse_hub(env) if env else None


def parse_remote(text: str, hub: Hub | None = None) -> RemoteRef:
    """Parse ``[HUB/]NS/NAME[:TAG]``; ``hub`` (or FORKD_HUB) applies when none is written."""
    if "\x00" in text or len(text) > 600:
        raise InvalidInput("remote reference is too long or contains NUL")
    rest = text
    for prefix in ("http://", "https://"):
        if rest.startswith(prefix):
            host, _, rest = rest[len(prefix) :].partition("/")
            hub = parse_hub(prefix + host)
            break
    else:
        first, sep, remainder = rest.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            hub, rest = parse_hub(first), remainder
    hub = hub or default_hub()
    if hub is None:
        raise InvalidInput(
            f"{text!r} names no hub and FORKD_HUB is not set: write HUB/NS/NAME[:TAG] "
            "or export FORKD_HUB=host:port"
        )
    name, sep, tag = rest.rpartition(":")
    if not sep or "/" in tag:
        name, tag = rest, DEFAULT_TAG
    return RemoteRef(hub, validate_name(name), validate_tag(tag))
