"""JSON documents from untrusted peers, parsed with their nesting bounded first.

``json.loads`` recurses once per nesting level: a manifest, config or map made of
a few thousand ``[`` raises RecursionError (a 500 in the hub, a traceback in the
CLI). ``loads`` measures the nesting on the raw bytes (strings blanked out, then
brackets counted) and refuses anything deeper than ``MAX_DEPTH`` before the
parser sees it. Every document forkd reads from a peer goes through here, and so
do the hub's and the controller's JSON request bodies (``check_body``: hub/app.py
``HubHttpRequest``, controller/app.py ``check_request``).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, TypeGuard

from forkd.errors import InvalidInput
from forkd.names import shown

# forkd's own documents nest 4 deep; OCI manifests and indexes a few more. 64 leaves room.
MAX_DEPTH = 64
# A server parses a document bigger than this in a worker thread, not on its event loop:
# checking and parsing runs at Python speed on documents of small objects (about 0.3 s a
# MiB of ``{},``), and on the loop a 4 MiB manifest stalled every other request of the
# process for a second or more.
INLINE_MAX = 64 * 1024
# possessive: a long string is one C-speed run, not one regex step per byte (40 MiB of
# base64 took 15 s that way, 0.1 s this way); a string never ends inside a run anyway
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def skeleton(data: bytes) -> bytes:
    """``data`` without its strings: what a parser turns into containers, numbers and
    constants (Python objects of up to ~20 times the bytes: ``[],`` is a 56-byte list),
    where a string's bytes become about as many bytes of ``str``."""
    return _STRING.sub(b"", data)


def skeleton_and_strings(data: bytes) -> tuple[bytes, int]:
    """``skeleton(data)`` and how many strings were taken out of it (each one a ``str``
    object of its own when parsed), in one pass."""
    return _STRING.subn(b"", data)


def nesting(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (0 for a scalar)."""
    brackets = skeleton(data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(_STEP[c] for c in brackets), default=0)


def is_integer(value: object, low: int | None = None, high: int | None = None
               ) -> TypeGuard[int]:
    """Whether a peer's ``value`` is an integer in [``low``, ``high``] (an open end when
    None). A bool is not one (``true`` is not 1 in JSON, though Python's bool is an int),
    nor is a float such as ``4.0``: the one check of every count, size and limit taken
    from a document, a request or a config. An int subclass is one (``signal.SIGTERM``
    from an in-process caller)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def check_nesting(raw: bytes, what: str, max_depth: int = MAX_DEPTH) -> None:
    """InvalidInput when ``raw`` nests deeper than ``max_depth``; for a caller whose own
    parser recurses (``loads``, the hub's and the controller's request bodies)."""
    depth = nesting(raw)
    if depth > max_depth:
        raise InvalidInput(
            f"{what} nests {depth} levels deep, over the limit of {max_depth}: "
            "send a flatter document"
        )


class _Ambiguous(ValueError):
    """A document that parsers read differently (``loads``)."""


class _RepeatedKey(_Ambiguous):
    """An object that names a key twice (``_unique_keys``)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, unless it names a key twice: RFC 8259 leaves what that means to each
    parser (Python and Go keep the last, others the first), so one manifest would be two
    documents, e.g. a ``mediaType`` the hub checks and another a client acts on
    (CVE-2021-41190's kind of confusion), or ``layers`` the hub verified and others a
    client pulls."""
    out = dict(pairs)
    key = repeated_key(pairs, out)
    if key is not None:
        raise _RepeatedKey(f"key {shown(key)} appears twice in one object")
    return out


def repeated_key(pairs: list[tuple[str, Any]], parsed: dict[str, Any]) -> str | None:
    """The first key ``pairs`` (an object as the parser read it) names twice, or None;
    ``parsed`` is ``dict(pairs)`` (fewer keys than pairs only when one repeats)."""
    if len(parsed) == len(pairs):
        return None
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None  # (unreachable: parsed has fewer keys)


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259 section 6), though
    Python reads them as floats: refused like any other text that is not JSON."""
    raise _Ambiguous(f"{name} is not a JSON number")


def loads(data: bytes | str, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` as JSON; InvalidInput when it is not JSON (``NaN``, ``Infinity``
    included), names a key twice in one object (``_unique_keys``) or nests deeper than
    ``max_depth``. ``what`` names the document in the message."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    check_nesting(raw, what, max_depth)
    try:
        return _parse(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from exc


def check_body(raw: bytes, what: str = "the request body") -> None:
    """InvalidInput when ``raw``, a JSON request body another decoder is about to read
    (Litestar's msgspec), nests deeper than ``MAX_DEPTH`` or names a key twice in one
    object. msgspec keeps the last of a repeated key; the audit log, a proxy in front or the
    client's own reading may keep the first, so ``{"role": "reader", "role": "admin"}``
    would be two requests. A body that is not JSON at all is left to the decoder (its
    message says what the route expects)."""
    check_nesting(raw, what)
    try:
        _parse(raw)
    except _RepeatedKey as exc:
        raise InvalidInput(f"{what} is ambiguous: {exc}; send each key once") from exc
    except (ValueError, RecursionError):
        return  # not JSON: the decoder refuses it in its own words


def _parse(raw: bytes) -> Any:
    """The one parse of ``loads`` and ``check_body`` (nesting checked by the caller)."""
    return json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
