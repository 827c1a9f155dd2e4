"""Numbers and choices a client puts in an ``/api/v1`` or UI address: parsed strictly.

Litestar converts a ``{id:int}`` path segment with ``int()``, which takes ``'١٢'`` (Arabic-
Indic digits), ``'+1'``, ``' 1'``, ``'1_0'``, ``'-1'`` and a thousand digits (a 500 once
the database is asked about it), and an ``int`` query parameter through msgspec, which
takes ``'1.0'`` and ``'1e1'``. These routes take the text and parse it here instead: ASCII
decimal digits only (``oci.common.parse_count``, the one parser of client numbers), within
bounds, else 400 saying what was expected. A choice (``sort``) is a ``Literal``, parsed
by ``parse_sort``: another value is a 400 naming the ones there are (Litestar's own check
of a ``Literal`` parameter says "Invalid enum value" and not which ones are valid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from litestar.exceptions import ValidationException
from litestar.params import Parameter

from forkd.errors import InvalidInput
from forkd.hub.oci.common import parse_count

# Row ids (tokens): PostgreSQL ``integer``, the narrowest id column's range.
ID_MAX = (1 << 31) - 1
# How a list of repositories is ordered (the catalog API and the UI's search).
Sort = Literal["updated", "pulls", "name"]
SORT_CHOICES: tuple[Sort, ...] = get_args(Sort)
# The ``sort`` query parameter, as text: ``parse_sort`` parses it.
SortText = Annotated[
    str, Parameter(max_length=64, description="updated (the default), pulls or name")
]

# A number in a query string, as text: ``query_number`` parses it.
QueryNumber = Annotated[str | None, Parameter(max_length=64)]


def path_id(text: str, what: str) -> int:
    """A row id from an address (``what`` names it): 1 to ``ID_MAX`` in ASCII digits;
    else 400."""
    try:
        value = parse_count(text, what, ID_MAX)
    except InvalidInput as exc:
        raise ValidationException(f"{exc}; use the id the list of them shows") from exc
    if value < 1:
        raise ValidationException(f"{what} must be at least 1, got {text!r}")
    return value


def parse_sort(text: str) -> Sort:
    """A ``sort`` from a query string: one of ``SORT_CHOICES``, else 400 naming them."""
    for choice in SORT_CHOICES:
        if text == choice:
            return choice
    raise ValidationException(f"sort must be one of {', '.join(SORT_CHOICES)}, got {text[:40]!r}")


def query_number(text: str | None, what: str, default: int, most: int) -> int:
    """A query parameter that is a count from 1 (a page, a page size): ``default`` when
    absent, else 1 to ``most`` in ASCII digits; 400 otherwise."""
    if text is None:
        return default
    try:
        value = parse_count(text, what, most)
    except InvalidInput as exc:
        raise ValidationException(str(exc)) from exc
    if value < 1:
        raise ValidationException(f"{what} must be at least 1, got {text!r}")
    return value


PAGES_MAX = 100_000  # the last page number a list serves


@dataclass(frozen=True)
class Page:
    """Which page of a list: ``number`` from 1, ``size`` items each."""

    number: int
    size: int

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.size


def page_of(
    page: str | None, per_page: str | None, size: int, most: int, pages: int = PAGES_MAX
) -> Page:
    """``page`` (1-``pages``, default 1) and ``per_page`` (1-``most``, default ``size``)
    from a query string (``query_number``)."""
    return Page(
        query_number(page, "page", 1, pages), query_number(per_page, "per_page", size, most)
    )
