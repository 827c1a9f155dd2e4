"""Compact a tag on a forkd hub, from the blobs the hub already holds (nothing is uploaded).

``forkd compact --remote [HUB/]NS/NAME:TAG --to NEWTAG`` calls ``compact_remote``. The
hub's ``POST /api/v1/compact/NS/NAME`` takes the same credentials as ``/v2/``: the client
answers its token challenge with the ``repository:NS/NAME:pull,push`` scope. Other OCI
registries have no such API; they answer 404 and ``compact_remote`` raises
``RegistryNotFound``. A hub running its limit of compactions answers 429 with Retry-After:
the call waits that long (at most ``RETRY_AFTER_MAX`` seconds) and asks again, up to
``BUSY_TRIES`` times. The hub's answer is checked before anyone reads it
(``_checked_answer``): ``forkd compact --remote`` prints its numbers and digest, so a
hub's text in them (an escape sequence) or a field missing is a RegistryError.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from forkd import digest as dg
from forkd.errors import Conflict, InvalidInput
from forkd.jsondoc import is_integer
from forkd.names import validate_line, validate_name, validate_tag
from forkd.registry.client import RegistryClient, RegistryError, json_answer

BUSY_TRIES = 6  # asks while the hub runs its limit of compactions (429)
RETRY_AFTER_MAX = 30.0  # seconds waited between two asks, whatever Retry-After says


def _retry_after(value: str | None) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds; a date or junk: 10 s)."""
    try:
        seconds = float(value) if value is not None else 10.0
    except ValueError:
        seconds = 10.0
    if not math.isfinite(seconds):
        seconds = 10.0
    return min(max(seconds, 1.0), RETRY_AFTER_MAX)


def compact_remote(
    client: RegistryClient,
    repo: str,
    tag: str,
    to: str,
    force: bool = False,
    on_busy: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Flatten ``repo:tag``'s chain into a new flat tag ``repo:to`` on the hub. Returns the
    hub's answer: repository, tag, digest, depth (0), memory_size, stored_bytes, new_blobs,
    new_bytes, compacted_from {from_tag, from_digest, from_depth, reason}. ``on_busy``
    hears of each wait (seconds) while the hub is busy compacting."""
    validate_name(repo)
    validate_tag(tag)
    validate_tag(to)
    for attempt in range(1, BUSY_TRIES + 1):
        resp = client.request(
            "POST",
            f"/api/v1/compact/{repo}",
            client.push_scope(repo),
            ok=(201, 409, 429),
            json={"tag": tag, "to": to, "force": force},
        )
        if resp.status_code != 429:
            break
        if attempt == BUSY_TRIES:
            raise RegistryError(
                f"{client.hub}: the hub is running its limit of compactions and was still "
                f"busy after {BUSY_TRIES} tries; run the compaction again later"
            )
        wait = _retry_after(resp.headers.get("retry-after"))
        if on_busy is not None:
            on_busy(wait)
        time.sleep(wait)
    if resp.status_code == 409:
        raise Conflict(
            f"{client.hub}: tag {repo}:{to} exists; pick another tag or pass --force to replace it"
        )
    return _checked_answer(json_answer(resp, f"{client.hub}: compaction answer"),
                           f"{client.hub}: compaction answer")


_COUNTS = ("depth", "memory_size", "stored_bytes", "new_blobs", "new_bytes")
_TEXTS = ("repository", "tag")


def _checked_answer(answer: dict[str, Any], what: str) -> dict[str, Any]:
    """``answer`` when its fields are what docs/hub.md says (counts: non-negative
    integers; digests: digests; texts: one printable line), else RegistryError: the
    caller prints them on the user's terminal."""
    source = answer.get("compacted_from")
    try:
        if not isinstance(source, dict):
            raise InvalidInput("compacted_from is not an object")
        for key, doc in [*((k, answer) for k in _COUNTS), ("from_depth", source)]:
            value = doc.get(key)
            if not is_integer(value, 0):
                raise InvalidInput(f"{key} is not a non-negative integer")
        for key, doc in [("digest", answer), ("from_digest", source)]:
            value = doc.get(key)
            dg.validate_oci(value if isinstance(value, str) else "")
        for key, doc in [*((k, answer) for k in _TEXTS), ("from_tag", source),
                         ("reason", source)]:
            value = doc.get(key)
            if not isinstance(value, str):
                raise InvalidInput(f"{key} is not text")
            validate_line(value, key)
    except InvalidInput as exc:
        raise RegistryError(f"{what} is malformed ({exc}); is the address a forkd hub?"
                            ) from None
    return answer
