"""The controller against the eighth hostile review: a request's query read one way only
(an unknown or repeated parameter refused, as a JSON body's unknown field and repeated key
are), untrusted values quoted in errors saying when they were cut, and one client's share
of the daemon's VMs. No VM: the real app and protocol on uvicorn, and a fake guest agent
(daemon_support.FakeGuest)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from daemon_support import FakeGuest, running

from forkd.audit import AuditLog
from forkd.controller import app, server
from forkd.controller.backend import LocalBackend
from forkd.store.store import Store

TOKEN = "t" * 43


def _daemon_app(tmp_path: Path, backend: LocalBackend | None = None) -> Any:
    return app.create_app(backend or LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                          app.ControllerMetrics(), None)


@pytest.fixture
def unix(place: Path, tmp_path: Path) -> Iterator[httpx.Client]:
    """A client of the daemon's Unix-socket app and protocol."""
    sock = place / "ctl.sock"
    config = server.bounded_config(_daemon_app(tmp_path), server.UnixPeerProtocol,
                                   uds=str(sock))
    with running(uvicorn.Server(config)), httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd",
            timeout=20) as http:
        yield http


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message: str = r.json()["error"]["message"]
    return message


# -- the query of a request ---------------------------------------------------------------
def test_a_file_path_given_twice_is_refused_before_the_guest(
        unix: httpx.Client, guest: FakeGuest) -> None:
    """``?path=/a&path=/b``: Litestar took one of the two (which one is its choice; a proxy
    or a log in front may read the other) and wrote that file; a JSON body naming a key
    twice was refused for this reason already. Now either is a 400 naming the parameter,
    and nothing reaches the guest."""
    r = unix.put("/v1/sandboxes/sb-1/files?path=/etc/passwd&path=/tmp/x", content=b"x")
    assert "query parameter 'path' is given twice" in _error(r, 400)
    r = unix.get("/v1/sandboxes/sb-1/files?path=/tmp/x&path=/etc/shadow")
    assert "query parameter 'path' is given twice" in _error(r, 400)
    r = unix.delete("/v1/snapshots/tiny?cascade=false&cascade=true")
    assert "query parameter 'cascade' is given twice" in _error(r, 400)
    assert guest.requests == []


def test_a_misspelt_query_parameter_is_refused_not_ignored(
        unix: httpx.Client, guest: FakeGuest) -> None:
    """``?path=/k&mod=384`` wrote the file with the default mode 0644, silently (a key
    meant to be 0600 readable by all); JSON bodies refuse unknown fields for this reason.
    Now an unknown query parameter is a 400 naming it and what the route takes."""
    r = unix.put("/v1/sandboxes/sb-1/files?path=/root/key&mod=384", content=b"secret")
    message = _error(r, 400)
    assert "unknown query parameter 'mod'" in message, message
    assert "PUT /v1/sandboxes/{sandbox_id:str}/files: it takes mode, path" in message
    r = unix.put(f"/v1/sandboxes/sb-1/files?path=/a&<b>{'q' * 100}=1", content=b"")
    message = _error(r, 400)  # the URL is not repeated: only a plain word is named
    assert "unknown query parameter (a name of 103 characters" in message, message
    assert "<b>" not in message
    assert guest.requests == []
    guest.answer = {}
    r = unix.put("/v1/sandboxes/sb-1/files?path=/root/key&mode=384", content=b"secret")
    assert r.status_code == 204, r.text
    assert guest.requests[-1]["path"] == "/root/key"
    assert guest.requests[-1]["mode"] == 384


def _every_route() -> list[tuple[str, str]]:
    """(method, path) of every route of the app but the public ones, its parameters
    filled in with plausible values."""
    fill = {"{sandbox_id:str}": "sb-1", "{handle:str}": "p1", "{ref:path}": "tiny",
            "{tag:path}": "tiny"}
    routes = []
    for handler in app.ROUTES:
        if app.is_public(handler):
            continue
        for path in handler.paths:
            for key, value in fill.items():
                path = path.replace(key, value)
            assert "{" not in path, path
            routes.extend((method, path) for method in sorted(handler.http_methods))
    return routes


@pytest.mark.parametrize(("method", "path"), _every_route())
def test_every_route_refuses_a_query_parameter_it_does_not_take(
        unix: httpx.Client, guest: FakeGuest, method: str, path: str) -> None:
    """Every route, not only the file routes: a parameter a route does not take is a
    400 naming it, before any work (nothing reaches a guest), whatever the body."""
    r = unix.request(method, path + "?zz=1", content=b"{}",
                     headers={"content-type": "application/json"})
    assert "unknown query parameter 'zz'" in _error(r, 400)
    assert guest.requests == []


# -- untrusted values quoted in errors ---------------------------------------------------
CUT = re.compile(r"\(its first (\d+) of (\d+) characters\)")


def test_an_id_quoted_in_an_error_says_it_was_cut(unix: httpx.Client) -> None:
    """An error quoted the first 80 characters of a sandbox id, a reference, a handle, a
    repeated JSON key or an unknown field's message as if they were the whole value: its reader went
    looking for an id nobody sent. Now a cut value says how long it was."""
    long_id = "a" * 300
    cases = [
        unix.get(f"/v1/sandboxes/{long_id}"),
        unix.get(f"/v1/snapshots/{'b' * 5000}"),
        unix.post(f"/v1/sandboxes/sb-1/processes/p{'1' * 200}/wait", json={}),
        unix.post("/v1/sandboxes/sb-1/exec", headers={"content-type": "application/json"},
                  content=b'{"argv": ["a"], "%s": 1, "%s": 2}' % (b"k" * 150, b"k" * 150)),
        unix.post("/v1/sandboxes", json={"tag": "tiny", "z" * 300: 1}),
    ]
    lengths = [300, 5000, 201, 150, 300]  # (msgspec's message of the field is longer)
    for r, length in zip(cases, lengths, strict=True):
        message = _error(r, 400)
        cut = CUT.search(message)
        assert cut is not None, message
        assert int(cut.group(2)) == length or length == 300 < int(cut.group(2)), message
    short = _error(unix.get("/v1/sandboxes/A"), 400)
    assert "'A'" in short and CUT.search(short) is None, short
