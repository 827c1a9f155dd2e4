"""Names of packs: repository names and tags, validated before any use.

Grammar (the OCI Distribution spec's): a repository name is one or more
path components ``[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*`` joined by ``/``, at most
255 characters; a tag is ``[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}``. A local
reference is ``NAME[:TAG]`` with ``latest`` as the default tag. Anything else
(``..``, absolute paths, NUL bytes, upper case names, over-long input) is
refused before it reaches a file system path or a database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from forkd.errors import InvalidInput

NAME_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
NAME_RE = re.compile(rf"^{NAME_COMPONENT}(?:/{NAME_COMPONENT})*$")
TAG_RE = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$")
MAX_NAME = 255
DEFAULT_TAG = "latest"


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not NAME_RE.match(name):
        raise InvalidInput(
            f"invalid repository name {name[:80]!r}: use lowercase letters, digits and "
            "'.', '_', '-' separators, components joined by '/', at most 255 characters"
        )
    return name


def validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_RE.match(tag):
        raise InvalidInput(
            f"invalid tag {tag[:80]!r}: use letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-'), at most 128 characters"
        )
    return tag


@dataclass(frozen=True, order=True)
class Ref:
    """A validated local reference ``name:tag``."""

    name: str
    tag: str

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


def parse_ref(text: str) -> Ref:
    """Parse ``NAME[:TAG]``; the tag defaults to ``latest``."""
    if not isinstance(text, str) or "\x00" in text or len(text) > MAX_NAME + 129:
        raise InvalidInput(f"invalid reference {str(text)[:80]!r}: too long or contains NUL")
    name, sep, tag = text.rpartition(":")
    if not sep or "/" in tag:
        name, tag = text, DEFAULT_TAG
    return Ref(validate_name(name), validate_tag(tag))
