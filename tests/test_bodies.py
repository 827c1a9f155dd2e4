"""The one reader of a request's announced body size (forkd.bodies.announced_size), which
the hub's body budget, the daemon's and `forkd mcp`'s body bounds all use: the forms a
Content-Length header may come in, and what each is taken for."""

from __future__ import annotations

import pytest

from forkd.bodies import announced_size, held_size


def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


@pytest.mark.parametrize(("headers", "size"), [
    ((), 0),
    (((b"content-length", b"0"),), 0),
    (((b"content-length", b"1234"),), 1234),
    (((b"content-length", b" 77 "),), 77),
    (((b"transfer-encoding", b"chunked"),), None),
    (((b"content-length", b"-5"),), None),
    (((b"content-length", b"1e9"),), None),
    (((b"content-length", b"9" * 19),), int("9" * 19)),
    (((b"content-length", b"9" * 20),), None),
    (((b"content-length", b"9" * 100_000),), None),
])
def test_a_body_size_is_read_one_way(headers: tuple[tuple[bytes, bytes], ...],
                                     size: int | None) -> None:
    assert announced_size(scope(*headers)) == size


def test_what_a_body_may_make_a_server_hold_is_never_past_its_route_bound() -> None:
    assert held_size(scope((b"content-length", b"10")), 100) == 10
    assert held_size(scope((b"content-length", b"1000")), 100) == 100
    assert held_size(scope((b"transfer-encoding", b"chunked")), 100) == 100
    assert held_size(scope((b"content-length", b"9" * 100_000)), 100) == 100
    assert held_size(scope(), 100) == 0
