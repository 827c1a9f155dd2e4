"""The catalog web UI: server-rendered pages for browsing packs, signing in and managing
tokens and teams, plus the README API. ``create_app`` mounts ``ui_router(hub)``.

URL layout: ``/`` home, ``/-/…`` the hub's own pages (``-`` can never start a
namespace, so these never shadow one), ``/NS`` a user or organisation,
``/NS/NAME`` a pack, ``/NS/NAME/-/tags/REF`` a tag (REF: tag or digest).
"""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.di import Provide
from litestar.static_files import create_static_files_router

from forkd.hub.services import Hub
from forkd.hub.ui.account import AccountController
from forkd.hub.ui.api import ReadmeController
from forkd.hub.ui.common import UI
from forkd.hub.ui.pages import BrowseController
from forkd.hub.ui.queries import FactsCache
from forkd.hub.ui.render import Renderer
from forkd.hub.ui.session import Sessions

STATIC = Path(__file__).parent / "static"


def ui_router(hub: Hub) -> Router:
    sessions = Sessions(hub.key)
    hub.rekeyed.append(sessions.rekey)
    ui = UI(Renderer(), sessions, FactsCache(readers=hub.readers))

    def provide_ui() -> UI:
        return ui

    static = create_static_files_router(
        path="/-/static",
        directories=[STATIC],
        include_in_schema=False,
    )
    return Router(
        path="/",
        route_handlers=[ReadmeController, AccountController, BrowseController, static],
        dependencies={"ui": Provide(provide_ui, use_cache=True, sync_to_thread=False)},
    )
