"""Remote references: ``[HUB/]NAMESPACE/NAME[:TAG]``; without a hub, the default hub.

A first component is a hub when it contains ``.`` or ``:`` or is ``localhost``
(the docker convention); a hub may carry an ``http://`` or ``https://``
scheme. Loopback hubs (``localhost``, ``127.0.0.0/8``, ``[::1]``) default to
plain HTTP, every other hub to HTTPS.

The default hub, used when a reference names none: ``$FORKD_HUB``, else the one
stored in the client config file (``forkd config set hub HOST[:PORT]``), else
an error that says how to set one. Commands that take a remote reference
(``pull``, ``push``'s second argument, ``compact --remote``) always read it as
remote, so ``NS/NAME`` there means the default hub, never a local tag.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from forkd.errors import InvalidInput
from forkd.names import DEFAULT_TAG, shown, validate_name, validate_tag
from forkd.registry import credentials

HUB_ENV = "FORKD_HUB"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(
    rf"(?P<host>{_LABEL}(?:\.{_LABEL})*|\[(?P<v6>[0-9a-fA-F:.]+)\])(?::(?P<port>[0-9]{{1,5}}))?"
)
_MAX_HOST = 255
SET_HUB_HINT = "`forkd config set hub HOST[:PORT]`"


@dataclass(frozen=True)
class Hub:
    host: str  # host[:port]
    scheme: str  # "http" or "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    @property
    def address(self) -> str:
        """What to write to name this hub again: ``HOST[:PORT]``, with the scheme only
        when it is not the one the host gets by default (``parse_hub(h.address) == h``)."""
        return self.host if self.scheme == default_scheme(self.host) else self.url

    def __str__(self) -> str:
        return self.host


@dataclass(frozen=True)
class RemoteRef:
    hub: Hub
    name: str
    tag: str

    def __str__(self) -> str:
        return f"{self.hub}/{self.name}:{self.tag}"


@dataclass(frozen=True)
class DefaultHub:
    """The default hub and where it came from (``$FORKD_HUB`` or the config file)."""

    hub: Hub
    source: str
    set_by: str  # "env", "user" or "quickstart"


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a DNS name such as 127.example.com is not loopback


def default_scheme(host: str) -> str:
    """The scheme a hub address without one gets: http on loopback, else https."""
    return "http" if _is_loopback(host) else "https"


def parse_hub(text: str) -> Hub:
    """``[http://|https://]HOST[:PORT]``: a DNS name, an IPv4 address or ``[IPv6]``,
    port 1-65535. Anything else (paths, user info, spaces, control characters) is refused."""
    scheme = ""
    for prefix in ("http://", "https://"):
        if text.startswith(prefix):
            scheme, text = prefix[:-3], text[len(prefix) :]
    text = text.removesuffix("/")
    match = _HOST_RE.fullmatch(text) if len(text) <= _MAX_HOST else None
    if match is None or not _valid_parts(match):
        raise InvalidInput(
            f"invalid hub address {shown(text)}: expected HOST[:PORT] (a DNS name, an IPv4 "
            "address or [IPv6], port 1-65535), optionally after http:// or https://"
        )
    return Hub(text, scheme or default_scheme(text))


def _valid_parts(match: re.Match[str]) -> bool:
    port = match.group("port")
    if port is not None and not 1 <= int(port) <= 65535:
        return False
    v6 = match.group("v6")
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            return False
    return True


def env_hub() -> Hub | None:
    """The hub named by ``$FORKD_HUB``, or None when it is unset or empty."""
    text = os.environ.get(HUB_ENV)
    if not text:
        return None
    try:
        return parse_hub(text)
    except InvalidInput as exc:
        raise InvalidInput(f"{HUB_ENV}: {exc}; export {HUB_ENV}=HOST[:PORT] or unset it") from exc


def configured_hub() -> DefaultHub | None:
    """The default hub stored in the client config file, validated, or None."""
    stored = credentials.load_default_hub()
    if stored is None:
        return None
    path = credentials.config_path()
    try:
        hub = parse_hub(stored.address)
    except InvalidInput as exc:
        raise InvalidInput(
            f"the default hub in {path} is not usable: {exc}; set another with "
            f"{SET_HUB_HINT} or remove it with `forkd config unset hub`"
        ) from exc
    return DefaultHub(hub, str(path), stored.set_by)


def resolve_default_hub() -> DefaultHub | None:
    """``$FORKD_HUB`` beats the config file; None when neither names a hub."""
    hub = env_hub()
    if hub is not None:
        return DefaultHub(hub, f"${HUB_ENV}", "env")
    return configured_hub()


def default_hub() -> Hub | None:
    chosen = resolve_default_hub()
    return chosen.hub if chosen else None


def parse_remote(text: str, hub: Hub | None = None) -> RemoteRef:
    """Parse ``[HUB/]NS/NAME[:TAG]``; ``hub``, else the default hub, applies when none is
    written."""
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
            f"{text!r} names no hub, {HUB_ENV} is not set and no default hub is configured: "
            f"write HUB/NS/NAME[:TAG], export {HUB_ENV}=HOST[:PORT] or run {SET_HUB_HINT}"
        )
    name, sep, tag = rest.rpartition(":")
    if not sep or "/" in tag:
        name, tag = rest, DEFAULT_TAG
    return RemoteRef(hub, validate_name(name), validate_tag(tag))


def set_default_hub(hub: Hub, set_by: str = "user") -> str:
    """Store ``hub`` as the default hub in the client config file; returns the file's path."""
    return str(credentials.save_default_hub(hub.address, set_by))
