"""Errors of UI pages become pages (never stack traces or JSON)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.datastructures import State
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from forkd.bodies import explained
from forkd.errors import Conflict, InvalidInput
from forkd.hub.ui.render import Renderer
from forkd.hub.ui.session import COOKIE, read_cookie

log = logging.getLogger("forkd.hub.ui")
_renderer: Renderer | None = None

TITLES = {
    400: "Bad request",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed",
    409: "Changed meanwhile",
}


def _page(request: Request[Any, Any, State], status: int, title: str, detail: str) -> Response[str]:
    global _renderer
    if _renderer is None:
        _renderer = Renderer()
    signed_in = bool(read_cookie(request, COOKIE))
    return _renderer.page(
        "error.html",
        status=status,
        title=title,
        detail=detail,
        status_code=status,
        path=request.url.path,
        maybe_private=status == 404 and not signed_in,
        viewer=None,
        hub_host="",
        here=request.url.path,
        q="",
    )


def http_error(request: Request[Any, Any, State], exc: Exception) -> Response[str]:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    detail = exc.detail if status < 500 else "something went wrong on the hub"
    if isinstance(exc, ValidationException):  # its detail repeats the URL, query included
        detail = explained(exc)
    if isinstance(exc, NotFoundException) and not detail:
        detail = "There is nothing here."
    return _page(request, status, TITLES.get(status, "Error"), detail)


def invalid_input(request: Request[Any, Any, State], exc: Exception) -> Response[str]:
    """A value the hub refused (e.g. one the database cannot store): 400, as a page."""
    return _page(request, 400, TITLES[400], str(exc))


def conflict(request: Request[Any, Any, State], exc: Exception) -> Response[str]:
    """A change another request made first (hub/db.py ``ConcurrentChange``) that the form
    did not answer itself: 409, as a page."""
    return _page(request, 409, TITLES[409], str(exc))


def server_error(request: Request[Any, Any, State], exc: Exception) -> Response[str]:
    log.error("error rendering %s", request.url.path, exc_info=exc)
    return _page(request, 500, "Hub error", "Something went wrong on the hub; it was logged.")


HTML_ERRORS: dict[type[Exception] | int, Any] = {
    HTTPException: http_error,
    # by name too: the app's JSON handler for it would be found first (the exact class)
    ValidationException: http_error,
    InvalidInput: invalid_input,
    Conflict: conflict,
    500: server_error,
}
