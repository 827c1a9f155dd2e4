"""forkd.jsondoc: nesting is bounded before the parser recurses."""

import pytest

from forkd.errors import InvalidInput
from forkd.jsondoc import MAX_DEPTH, check_body, loads, nesting


def test_flat_documents_parse() -> None:
    assert loads(b'{"a": [1, {"b": "[[[{{"}]}', "doc") == {"a": [1, {"b": "[[[{{"}]}
    assert nesting(b'"[[[" ') == 0


def test_brackets_inside_strings_and_escapes_do_not_count() -> None:
    doc = b'{"s": "\\" [[[[[[ \\\\", "t": ["]]]"]}'
    assert nesting(doc) == 2
    assert loads(doc, "doc")["t"] == ["]]]"]


def test_deep_nesting_is_refused_before_parsing() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(InvalidInput, match="nests 100000 levels"):
        loads(deep, "manifest")
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert nesting(ok) == MAX_DEPTH
    loads(ok, "manifest")


def test_not_json_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="config is not valid JSON"):
        loads(b"{nope", "config")


def test_a_request_body_naming_a_key_twice_is_refused_and_not_json_is_left_alone() -> None:
    with pytest.raises(InvalidInput, match="'admin' appears twice"):
        check_body(b'{"name": "a", "admin": false, "admin": true}')
    with pytest.raises(InvalidInput, match="'k' appears twice"):
        check_body(b'[{"x": {"k": 1, "k": 2}}]')
    with pytest.raises(InvalidInput, match="nests 100 levels"):
        check_body(b"[" * 100 + b"]" * 100)
    for raw in (b"", b"{nope", b'{"n": NaN}', b"\xff\xfe"):  # the decoder's to refuse
        check_body(raw)
    check_body(b'{"a": {"k": 1}, "b": {"k": 2}}')  # one key in each of two objects
