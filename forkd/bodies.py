"""JSON request bodies of the hub's and the controller's APIs, and what was wrong with one.

Both services decode bodies with Litestar (msgspec): a body type derives from ``Body``, so
an unknown field is refused (a misspelt ``repository`` or ``expires_in_days`` is a 400,
never a default that widens access or never expires). ``problems`` says what msgspec
found, field by field, without the request's URL: Litestar's own detail ("Validation
failed for POST /path?query") echoes whatever the client put in the query string.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.exceptions import ValidationException

from forkd.names import clipped

MAX_PROBLEM = 200  # characters of one field's message in an answer
MAX_LENGTH_DIGITS = 19  # a Content-Length of more digits is past any bound, unconverted


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body: unknown fields are refused."""


def announced_size(scope: Any) -> int | None:
    """The size of body an ASGI request's head announces: its Content-Length (0: no body),
    or None when the size is known only once the body is read (chunked) or the length is
    not a number this reader takes (past 19 digits, or not digits: the server's parser
    refuses those first). A caller bounds None by the most its route takes. The hub's and
    the daemon's bounds on bodies, and `forkd mcp`'s, all read a body's size here."""
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length")
    if length is None:
        return None if b"transfer-encoding" in headers else 0
    digits = length.strip()
    if not digits.isdigit() or len(digits) > MAX_LENGTH_DIGITS:
        return None
    return int(digits)


def held_size(scope: Any, most: int) -> int:
    """What a request's body may make a server hold: its announced size, at most ``most``
    (the most its route takes), and ``most`` when the size is not announced."""
    announced = announced_size(scope)
    return most if announced is None else min(announced, most)


def explained(exc: ValidationException) -> str:
    """The message of a ValidationException: a route's own (``raise
    ValidationException("expires_days must be ...")``) as it is, and Litestar's ("Validation
    failed for METHOD URL", the URL with its query) replaced by ``problems``."""
    detail = str(exc.detail)
    if detail.startswith("Validation failed for ") or not detail:
        return f"invalid request: {problems(exc)}"
    return detail


def problems(exc: ValidationException) -> str:
    """What msgspec said about each field, e.g. "Object contains unknown field `nn`"
    (each message bounded: a message can carry a value the client sent)."""
    extra = exc.extra if isinstance(exc.extra, list) else [exc.extra]
    said = [clipped(_problem(e), MAX_PROBLEM) for e in extra if e]
    return "; ".join(said) or "the request does not match the API"


def _problem(entry: Any) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    key = clipped(str(entry.get("key") or ""))
    source = entry.get("source")
    source = getattr(source, "value", source)  # a ParamType: "query", not "ParamType.QUERY"
    where = f" ({source} parameter {key})" if source and key else f" (field {key})" if key else ""
    return str(entry.get("message", entry)) + where
