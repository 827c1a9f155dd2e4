from __future__ import annotations

import pytest

from forkd import digest as dg
from forkd.errors import InvalidInput
from forkd.names import parse_ref


@pytest.mark.parametrize(
    "text,expected",
    [
        ("base", "base:latest"),
        ("deeplethe/langgraph-react:v1", "deeplethe/langgraph-react:v1"),
        ("a.b_c/d--e:TAG_1.2-x", "a.b_c/d--e:TAG_1.2-x"),
    ],
)
def test_valid_refs(text: str, expected: str) -> None:
    assert str(parse_ref(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        "../x",
        "/etc/passwd",
        "a/../b",
        "a\x00b",
        "UPPER",
        "a" * 256,
        "name:" + "t" * 129,
        "name:.hidden",
        "",
        "a//b",
        "a/",
        "x:y:z",
    ],
)
def test_hostile_refs_rejected(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_ref(text)


def test_digest_validation() -> None:
    good = dg.of_bytes(b"hello")
    assert dg.validate(good) == good
    assert dg.hex_part(good) == good.split(":")[1]
    for bad in ["sha256:xyz", "md5:" + "0" * 32, "sha256:" + "A" * 64, "sha256:../../etc"]:
        with pytest.raises(InvalidInput):
            dg.validate(bad)
