"""Every validator of untrusted names matches the whole text, ASCII only (issue 10 item 9).

``re.match(r"^...$")`` accepts a trailing newline (``$`` matches before a final
"\\n"), and unicode look-alikes must never pass for ASCII names. Each validator gets
its good value accepted and every hostile variant of it refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from forkd import digest as dg
from forkd import names
from forkd.errors import InvalidInput
from forkd.registry.reference import parse_hub

Validator = Callable[[str], object]


def _recipe_name(value: str) -> object:
    from forkd.engine import recipe

    return recipe.parse(f"[recipe]\nname = {json.dumps(value)}\n")


def _recipe_package(value: str) -> object:
    from forkd.engine import recipe

    packages = json.dumps(["python3", value])
    return recipe.parse(f'[recipe]\nname = "box"\n[packages]\napt = {packages}\n')


def _upload_id(value: str) -> object:
    from forkd.hub.storage import validate_upload_id

    return validate_upload_id(value)


VALIDATORS: dict[str, tuple[Validator, str]] = {
    "repository name": (names.validate_name, "acme/app"),
    "tag": (names.validate_tag, "v1"),
    "namespace": (names.validate_namespace, "bobco"),
    "user name": (names.validate_username, "alice"),
    "team name": (names.validate_team, "dev"),
    "reference": (names.parse_ref, "acme/app:v1"),
    "digest": (dg.validate, "sha256:" + "a" * 64),
    "blake3": (dg.validate_blake3, "a" * 64),
    "hub address": (parse_hub, "hub.example.com:5000"),
    "upload id": (_upload_id, "a" * 32),
    "recipe name": (_recipe_name, "box"),
    "recipe package": (_recipe_package, "curl"),
}

# Look-alikes of ASCII letters: Cyrillic а е о с, Kelvin sign, dotless i, fullwidth a.
_LOOKALIKE = {"a": "\u0430", "e": "\u0435", "o": "\u043e", "c": "\u0441"}


def _lookalike(good: str) -> str:
    for ascii_char, other in _LOOKALIKE.items():
        if ascii_char in good:
            return good.replace(ascii_char, other, 1)
    return good + "\u0430"


def hostile(good: str) -> dict[str, str]:
    """Variants of ``good`` that no validator may accept."""
    head, tail = good[:1], good[1:]
    return {
        "trailing newline": good + "\n",
        "trailing CRLF": good + "\r\n",
        "leading newline": "\n" + good,
        "inner newline": head + "\n" + tail,
        "carriage return": good + "\r",
        "tab": good + "\t",
        "vertical tab": good + "\x0b",
        "form feed": good + "\x0c",
        "next line U+0085": good + "\x85",
        "line separator U+2028": good + "\u2028",
        "no-break space": good + "\u00a0",
        "leading space": " " + good,
        "trailing space": good + " ",
        "NUL": good + "\x00",
        "inner NUL": head + "\x00" + tail,
        "zero-width joiner": head + "\u200d" + tail,
        "zero-width space": good + "\u200b",
        "cyrillic look-alike": _lookalike(good),
        "fullwidth first letter": chr(ord(head) + 0xFEE0) + tail,
        "kelvin sign": good + "\u212a",
        "dotless i": good + "\u0131",
        "empty": "",
    }


CASES = [
    pytest.param(fn, bad, id=f"{what}-{variant}")
    for what, (fn, good) in VALIDATORS.items()
    for variant, bad in hostile(good).items()
]


@pytest.mark.parametrize("what", list(VALIDATORS))
def test_good_values_pass(what: str) -> None:
    fn, good = VALIDATORS[what]
    fn(good)


@pytest.mark.parametrize("fn,bad", CASES)
def test_hostile_values_are_refused(fn: Validator, bad: str) -> None:
    with pytest.raises(InvalidInput):
        fn(bad)


@pytest.mark.parametrize(
    "pattern",
    [names.NAME_RE, names.NAMESPACE_RE, names.TAG_RE, names.USER_RE, names.TEAM_RE],
    ids=["name", "namespace", "tag", "user", "team"],
)
def test_exported_patterns_match_whole_text_even_with_match(pattern: object) -> None:
    """Callers that still use ``.match`` on the shared patterns get a full match."""
    import re

    assert isinstance(pattern, re.Pattern)
    assert pattern.match("abc") is not None
    for bad in ("abc\n", "abc\r\n", "abc\u2028"):
        assert pattern.match(bad) is None
        assert pattern.search(bad) is None


@pytest.mark.parametrize(
    "fn",
    [
        names.validate_name,
        names.validate_tag,
        names.validate_namespace,
        names.validate_username,
        names.validate_team,
        names.parse_ref,
        dg.validate,
        dg.validate_blake3,
    ],
)
def test_non_strings_are_refused(fn: Validator) -> None:
    for bad in (None, 5, b"acme", ["acme"]):
        with pytest.raises(InvalidInput):
            fn(bad)  # type: ignore[arg-type]


def test_hub_accounts_use_the_core_validators() -> None:
    from forkd.hub import accounts

    assert accounts.validate_username is names.validate_username
    assert accounts.validate_namespace is names.validate_namespace
    assert accounts.validate_team is names.validate_team
    assert accounts.USER_RE is names.USER_RE


@pytest.mark.parametrize("suffix", ["\n", "\r", "\t", "\x00", "\u2028", "\x0b"])
def test_token_scope_with_a_control_character_grants_nothing(suffix: str) -> None:
    from forkd.hub.auth import _requested

    assert _requested(["repository:acme/app:pull"]) == {"acme/app": frozenset({"pull"})}
    assert _requested([f"repository:acme/app:pull{suffix}"]) == {}


def test_name_limits_still_hold() -> None:
    names.validate_name("a" * 255)
    names.validate_tag("t" * 128)
    names.validate_username("u" * 64)
    for fn, bad in [
        (names.validate_name, "a" * 256),
        (names.validate_tag, "t" * 129),
        (names.validate_namespace, "n" * 256),
        (names.validate_username, "u" * 65),
        (names.validate_username, "a__b"),
        (names.validate_team, "t" * 65),
        (names.validate_team, "-dev"),
    ]:
        with pytest.raises(InvalidInput):
            fn(bad)


def test_upload_id_pattern_matches_whole_text_for_gc() -> None:
    """`forkd hub gc` picks upload files by ``UPLOAD_ID_RE.match``: no newline may pass."""
    from forkd.hub.storage import UPLOAD_ID_RE

    assert UPLOAD_ID_RE.match("a" * 32) is not None
    assert UPLOAD_ID_RE.match("a" * 32 + "\n") is None
