"""What every UI handler shares: the UI's state, who is viewing, and input validation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from litestar import Request
from litestar.datastructures import State
from litestar.exceptions import ValidationException

from forkd.errors import InvalidInput
from forkd.hub.services import Hub
from forkd.hub.ui.queries import FactsCache
from forkd.hub.ui.render import Renderer
from forkd.hub.ui.session import Sessions, Viewer

HubRequest = Request[object, object, State]
# Search text: what a repository name or a short description may contain.
QUERY_RE = re.compile(r"^[a-z0-9 ._/-]{0,100}$")


@dataclass
class UI:
    """Built once per app by ``ui_router``."""

    renderer: Renderer
    sessions: Sessions
    facts: FactsCache


def hub_host(hub: Hub, request: HubRequest) -> str:
    """The HOST[:PORT] that goes in ``forkd pull HOST/NS/NAME:TAG``."""
    if hub.settings.public_url:
        return urlsplit(hub.settings.public_url).netloc
    return request.url.netloc


async def viewer(ui: UI, hub: Hub, request: HubRequest) -> Viewer:
    return await ui.sessions.viewer(hub, request)


def base_context(ui: UI, hub: Hub, request: HubRequest, who: Viewer) -> dict[str, Any]:
    return {
        "viewer": who,
        "hub_host": hub_host(hub, request),
        "here": request.url.path,
        "q": "",
    }


def checked_query(text: str | None) -> str:
    value = (text or "").strip().lower()
    if not QUERY_RE.fullmatch(value):
        raise ValidationException(
            "search text may use lowercase letters, digits, spaces and . _ / - (at most 100)"
        )
    return value


def invalid(exc: InvalidInput) -> ValidationException:
    return ValidationException(str(exc))


def local_path(target: str | None) -> str:
    """A redirect target that stays on this site (no scheme, no host, no ``//``)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/"
    return target
