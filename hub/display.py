"""Text the hub stored for others to read, made safe where it is shown.

What a client stores for others (an API token's name, a pack's description, a team's
glob) is checked when it is written (``forkd.names.validate_line``), but rows written
before a check existed, by another tool or by hand, and text no write check covers (a
manifest's annotations, which the OCI spec lets be any string) are still read back as
stored. Every path that shows such text runs it through one of these: a terminal's
escape sequence (``ESC ] 52`` writes the clipboard), a carriage return, a C1 control or a
bidi override (U+202E reorders what follows) becomes its visible escape (``\\x1b``,
``\\u202e``), never an instruction to the reader's terminal or page.
"""

from __future__ import annotations

import sys

from markupsafe import Markup

from forkd import names
from forkd.names import inert


def shown_text(text: str) -> str:
    """``text`` with every character a terminal or a page acts on (``forkd.names.inert``:
    C0 and C1 controls, DEL, bidi marks and overrides, line separators) written as its
    escape; newlines and tabs stay (a page shows them as spaces). Never cut."""
    return inert(text, sys.maxsize)


def one_line(text: str) -> str:
    """``text`` shown as one line, never cut: ``forkd.names.one_line`` (``shown_text``,
    and newlines and tabs written as ``\\x0a`` and ``\\x09`` too), so a stored value
    cannot forge a line or a column of a tab-separated listing (``forkd hub token
    list``)."""
    return names.one_line(text, sys.maxsize)


def optional_line(text: str | None) -> str | None:
    """``one_line`` of a value that may be absent."""
    return None if text is None else one_line(text)


def page_value(value: object) -> object:
    """The UI templates' ``finalize``: every plain text a page shows goes through
    ``shown_text``; markup the hub made safe itself (a rendered README) is left as it is."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return shown_text(value)
    return value
