"""The controller against the eighth hostile review: a request's query read one way only
(an unknown or repeated parameter refused, as a JSON body's unknown field and repeated key
are), untrusted values quoted in errors saying when they were cut, and one client's share
of the daemon's VMs. No VM: the real app and protocol on uvicorn, and a fake guest agent
(daemon_support.FakeGuest)."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from click.testing import CliRunner
from daemon_support import MCP_HELLO, FakeEngine, FakeGuest, mcp_auth, running
from net_support import PATIENCE_S, free_port, wait_until

from forkd import audit as audit_module
from forkd.audit import AuditLog
from forkd.cli.controller_cmds import serve
from forkd.controller import app, server
from forkd.controller.backend import LocalBackend
from forkd.controller.client import answered_error
from forkd.engine import agent_client as ac
from forkd.engine import children as ch
from forkd.engine.errors import Busy
from forkd.engine.pool import Pool
from forkd.errors import InvalidInput
from forkd.store.store import Store

TOKEN = "t" * 43
MIB = 1 << 20


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


# -- one client's share of the daemon's VMs -----------------------------------------------
@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine()
    monkeypatch.setattr(ch, "fork", fake.fork)
    monkeypatch.setattr(ch, "list_children", fake.list_children)
    return fake


@pytest.fixture
def limited_tcp(place: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The daemon's TCP app and protocol (token TOKEN) running at most 4 VMs (so 2 of one
    client, the default share), with a pool."""
    port = free_port()
    store = Store.open()
    backend = LocalBackend(store, Pool(store), max_sandboxes=4)
    token = app.Token(TOKEN.encode())
    watched = app.TokenWatch(app.create_app(backend, AuditLog(tmp_path / "a.log"),
                                            app.ControllerMetrics(), token), token)
    config = server.bounded_config(watched, server.BoundedProtocol, host="127.0.0.1",
                                   port=port)
    try:
        with running(uvicorn.Server(config)):
            yield ("127.0.0.1", port)
    finally:
        backend.close()


def _client(where: tuple[str, int], source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source),
                        base_url=f"http://{where[0]}:{where[1]}", timeout=20,
                        headers={"Authorization": f"Bearer {TOKEN}"})


def test_one_client_runs_at_most_its_share_of_the_daemons_vms(
        limited_tcp: tuple[str, int], engine: FakeEngine) -> None:
    """The daemon runs at most --max-sandboxes VMs, and one client could start all of them
    (spawns, a pool): every other client's spawn was a 409 until it killed some. Now one
    client (an address on TCP, a uid on the socket) runs at most its share, half by
    default: past it a 429 says whose share and what to do, and the others keep theirs."""
    with _client(limited_tcp, "127.0.0.1") as mine, _client(limited_tcp, "127.0.0.2") as theirs:
        r = mine.post("/v1/sandboxes", json={"tag": "tiny", "n": 2})
        assert r.status_code == 201, r.text
        for refused in (mine.post("/v1/sandboxes", json={"tag": "tiny"}),
                        mine.post("/v1/pools", json={"tag": "tiny", "k": 1})):
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            message = refused.json()["error"]["message"]
            assert "this client (127.0.0.1) runs 2" in message, message
            assert "one client's share is 2 of the daemon's 4" in message, message
            assert "--max-sandboxes-per-client" in message and "kill or pause" in message
        assert engine.forks == 2
        r = theirs.post("/v1/sandboxes", json={"tag": "tiny", "n": 2})
        assert r.status_code == 201, r.text  # the other client's share was kept for it
        engine.end("sb-1")  # one of the first client's sandboxes ended: room for one more
        r = mine.post("/v1/sandboxes", json={"tag": "tiny"})
        assert r.status_code == 201, r.text
        assert engine.forks == 5


def test_the_per_client_share_is_a_positive_integer(place: Path) -> None:
    with pytest.raises(InvalidInput, match="per-client sandbox limit must be a positive"):
        LocalBackend(Store.open(), max_sandboxes=4, max_per_client=0)
    assert LocalBackend(Store.open(), max_sandboxes=4).max_per_client == 2
    assert LocalBackend(Store.open(), max_sandboxes=1).max_per_client == 1
    assert LocalBackend(Store.open(), max_sandboxes=8, max_per_client=8).max_per_client == 8
    result = CliRunner().invoke(serve, ["--max-sandboxes-per-client", "0"])
    assert result.exit_code == 2 and "--max-sandboxes-per-client" in result.output


def test_a_guests_key_and_a_daemons_answer_quoted_in_errors_say_they_were_cut() -> None:
    """The same class where the text comes from the other untrusted sides: a guest frame
    naming a long key twice, and an answer that is not the daemon's error body (a proxy's
    page) shown by the SDK: both were quoted cut, as if whole."""
    key = "k" * 200
    frame = b'{"id": 1, "%s": 1, "%s": 2}' % (key.encode(), key.encode())
    with pytest.raises(ac.ProtocolViolation) as refused:
        ac.parse_frame(frame)
    assert "(its first 80 of 200 characters)" in str(refused.value), refused.value
    error = answered_error(502, b"<html>" + b"x" * 500 + b"</html>")
    assert "(its first 200 of 513 characters)" in str(error), error
    assert "(its first" not in str(answered_error(502, b"<html>bad gateway</html>"))


# -- one client's share of the audit budgets ---------------------------------------------
def _records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _tcp_daemon(log: Path) -> tuple[Any, tuple[str, int]]:
    """A daemon's TCP listener (the token TOKEN) on a free port of 127.0.0.1: its uvicorn
    config and its address."""
    port = free_port()
    token = app.Token(TOKEN.encode())
    ctl_app = app.create_app(LocalBackend(Store.open()), AuditLog(log),
                             app.ControllerMetrics(), token)
    config = server.bounded_config(app.TokenWatch(ctl_app, token), server.BoundedProtocol,
                                   host="127.0.0.1", port=port)
    return config, ("127.0.0.1", port)


def test_one_clients_flood_leaves_the_others_audit_records_written(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused tokens and failed writes are audited within a budget a minute (past it, only
    counted): one address that spent it (anyone can send refused requests; anyone with the
    token failed ones) hid every other client's attempts that minute, their addresses
    included, e.g. a token guesser behind a flood from another host. Now one client has
    half of each budget; the others' records are written, and the count of what was
    dropped names whose it was."""
    monkeypatch.setattr(app, "REFUSED_PER_MINUTE", 4)
    monkeypatch.setattr(app, "FAILED_PER_MINUTE", 4)
    log = tmp_path / "a.log"
    config, where = _tcp_daemon(log)
    with running(uvicorn.Server(config)), _client(where, "127.0.0.1") as flood, \
            _client(where, "127.0.0.2") as other:
        for _ in range(10):
            assert flood.get("/v1/sandboxes", headers={"Authorization": "Bearer x"}
                             ).status_code == 401
            assert flood.post("/v1/sandboxes/sb-1/exec", json={"argv": ["true"]}
                              ).status_code == 404
        assert other.get("/v1/pools", headers={"Authorization": "Bearer y"}).status_code == 401
        assert other.post("/v1/sandboxes/sb-2/exec", json={"argv": ["true"]}
                          ).status_code == 404
        records = _records(log)
        refused = [r["ip"].rsplit(":", 1)[0] for r in records if r["action"] == "auth"]
        failed = [r["ip"].rsplit(":", 1)[0] for r in records if r["result"] == "failed"]
        assert refused == ["127.0.0.1"] * 2 + ["127.0.0.2"], records
        assert failed == ["127.0.0.1"] * 2 + ["127.0.0.2"], records
        now = time.monotonic  # the next minute (for the audit's clock): the dropped are told
        monkeypatch.setattr(audit_module.time, "monotonic", lambda: now() + 61)
        assert other.get("/v1/pools", headers={"Authorization": "Bearer y"}).status_code == 401
    told = [r for r in _records(log) if r["action"] == "auth.suppressed"]
    assert len(told) == 1 and told[0]["count"] == 8, told
    assert told[0]["clients"] == {"127.0.0.1": 8}, told


# -- request bodies held at once ----------------------------------------------------------
def _started(where: tuple[str, int], source: str, request: bytes) -> socket.socket:
    """A connection from ``source`` that sent ``request`` (head, and what of the body)."""
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.settimeout(20)
    conn.bind((source, 0))
    conn.connect(where)
    conn.sendall(request)
    return conn


def _started_put(where: tuple[str, int], source: str, size: int, sent: int) -> socket.socket:
    """A connection from ``source`` that sent a PUT of a ``size``-byte file and ``sent`` of
    its bytes, and holds the rest."""
    return _started(where, source,
                    b"PUT /v1/sandboxes/sb-1/files?path=/tmp/f HTTP/1.1\r\nHost: forkd\r\n"
                    b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
                    % (TOKEN.encode(), size) + b"x" * sent)


def test_one_client_holds_at_most_its_share_of_request_bodies(
        place: Path, tmp_path: Path, guest: FakeGuest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file body (up to 32 MiB) is read whole into the daemon before its handler runs,
    and nothing bounded them together: one client with its 128 connections held 4 GiB of
    uploads at once (sent fast, or held open by sending slowly). Now the bodies being held
    count against a budget (app.BODY_BYTES), one client at most half of it: past that its
    next upload is a 429 at once, its body not read, and the other clients keep theirs."""
    monkeypatch.setattr(app, "BODY_BUDGET", app.BodyBudget(4 * MIB))
    guest.answer = {}
    config, where = _tcp_daemon(tmp_path / "a.log")
    with running(uvicorn.Server(config)), _client(where, "127.0.0.1") as mine, \
            _client(where, "127.0.0.2") as theirs:
        held = [_started_put(where, "127.0.0.1", MIB, 1000) for _ in range(2)]
        wait_until("both bodies count", lambda: app.BODY_BUDGET.held == 2 * MIB, PATIENCE_S)
        r = mine.put("/v1/sandboxes/sb-1/files", params={"path": "/tmp/g"}, content=b"y" * 100)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        message = r.json()["error"]["message"]
        assert "this client (127.0.0.1) has 2097152 bytes of request bodies" in message
        assert "one client holds at most 2097152" in message and "wait for its uploads" in message
        r = theirs.put("/v1/sandboxes/sb-1/files", params={"path": "/tmp/h"}, content=b"z" * MIB)
        assert r.status_code == 204, r.text  # another client's upload is served
        for conn in held:
            conn.close()
        wait_until("the held bodies are given back", lambda: app.BODY_BUDGET.held == 0, PATIENCE_S)
        r = mine.put("/v1/sandboxes/sb-1/files", params={"path": "/tmp/g"}, content=b"y" * 100)
        assert r.status_code == 204, r.text
    assert app.BODY_BUDGET.held == 0 and app.BODY_BUDGET.by_client == {}


def test_past_the_daemons_bound_of_request_bodies_any_client_waits() -> None:
    """The clients' shares together are the daemon's bound: past it a body is a 409 Busy
    for whoever sends it, and what was given back is free again."""
    budget = app.BodyBudget(4 * MIB)
    assert budget.take(2 * MIB, "a") is None and budget.take(2 * MIB, "b") is None
    refused = budget.take(1, "c")
    assert isinstance(refused, Busy) and "try again shortly" in str(refused), refused
    assert app.error_answer(refused)[0] == 409
    budget.give(2 * MIB, "a")
    assert budget.take(1, "c") is None and budget.by_client == {"b": 2 * MIB, "c": 1}


def test_an_mcp_message_over_http_is_bounded(place: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """`forkd mcp --transport http`: the MCP SDK read a POST's body whole, with no bound, so
    a client with the token made the server hold whatever it sent (a GiB in one request).
    Now a message is at most mcp.MAX_BODY_BYTES (413 past it, a Content-Length at once, a
    chunked body as soon as it passes it); a message within it is served."""
    from forkd.controller import mcp
    from forkd.controller.sdk import Controller

    monkeypatch.setattr(mcp, "MAX_BODY_BYTES", 64 << 10, raising=False)
    port = free_port()
    web = mcp.http_server(Controller(local=True), "127.0.0.1", port, "/mcp",
                          app.Token(TOKEN.encode()))
    auth = mcp_auth(TOKEN.encode())
    with running(web), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        big = {**MCP_HELLO, "params": {**MCP_HELLO["params"], "pad": "x" * (65 << 10)}}
        r = http.post("/mcp", json=big, headers=auth)
        assert r.status_code == 413, r.text
        assert f"over the {64 << 10} one MCP message may be" in r.text, r.text

        def chunks() -> Iterator[bytes]:
            yield json.dumps(big).encode()

        r = http.post("/mcp", content=chunks(), headers={**auth,
                                                          "content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = http.post("/mcp", content=(b for b in [json.dumps(MCP_HELLO).encode()]),
                      headers={**auth, "content-type": "application/json"})
        assert r.status_code == 200, r.text  # a chunked message within the bound is served
        r = http.post("/mcp", json=MCP_HELLO, headers=auth)
        assert r.status_code == 200, r.text
        r = http.post("/mcp", json=big)  # without the token: 401 first, nothing read
        assert r.status_code == 401, r.text


# -- what the audit log says of a streamed exec -------------------------------------------
def _stream_records(log: Path) -> list[tuple[str, Any]]:
    return [(r["result"], r.get("exit_code", r.get("error"))) for r in _records(log)
            if r["action"] == "sandbox.exec"]


def test_a_streamed_exec_is_audited_as_it_ended_not_ok_before_it_ran(
        place: Path, tmp_path: Path, guest: FakeGuest) -> None:
    """A streamed exec was recorded "ok" when its stream started, before anything ran: a
    command that failed (a guest's broken answer, a paused sandbox, a client past its share)
    or whose client left stood in the audit log as done. Now the start is recorded as
    "started" (what was asked, at once) and the end as it was: "ok" with the exit code,
    "failed" with the error sent, "cut" when the client left first."""
    sock = place / "ctl.sock"
    log = tmp_path / "a.log"
    config = server.bounded_config(app.create_app(
        LocalBackend(Store.open()), AuditLog(log), app.ControllerMetrics(), None),
        server.UnixPeerProtocol, uds=str(sock))
    with running(uvicorn.Server(config)), httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd",
            timeout=20) as http:
        url = "/v1/sandboxes/sb-1/exec/stream"
        guest.answer = {"status": "exited", "exit_code": 3}
        lines = http.post(url, json={"argv": ["false"]}).text.splitlines()
        assert json.loads(lines[-1])["result"]["exit_code"] == 3, lines
        guest.answer = {"status": "lied", "exit_code": "x"}  # not the protocol's answer
        lines = http.post(url, json={"argv": ["true"]}).text.splitlines()
        assert "does not match the protocol" in json.loads(lines[-1])["error"]["message"]
        assert _stream_records(log)[:2] == [("started", None), ("ok", 3)], _records(log)
        failed = _stream_records(log)[2:]
        assert failed[0] == ("started", None) and failed[1][0] == "failed", failed
        assert "does not match the protocol" in failed[1][1], failed
        guest.answer = None  # a command that never ends, and a client that leaves
        with http.stream("POST", url, json={"argv": ["sleep", "1000"]}):
            wait_until("the command runs", lambda: len(guest.requests) == 3, PATIENCE_S)
        wait_until("the cut stream is recorded",
                   lambda: _stream_records(log)[-1] == ("cut", None), PATIENCE_S)


# -- one client's share of the daemon's workers ------------------------------------------
def _started_exec(where: tuple[str, int], source: str) -> socket.socket:
    """A connection from ``source`` whose exec waits on a guest that never answers."""
    body = json.dumps({"argv": ["sleep", "100"]}).encode()
    return _started(where, source,
                    b"POST /v1/sandboxes/sb-1/exec HTTP/1.1\r\nHost: forkd\r\n"
                    b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (TOKEN.encode(), len(body), body))


def test_one_client_holds_at_most_half_of_the_daemons_workers(
        tmp_path: Path, guest: FakeGuest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocking handlers run in a pool of threads (anyio's 40 by default): one client's
    requests that wait (here execs on a guest that never answers; as well compacts,
    spawns, pool fills) took every worker, and every other client's kill or list waited
    behind them. Now one client has at most half of app.WORKERS in flight: its next is a
    429 at once, and another client is served."""
    monkeypatch.setattr(app, "REQUESTS", app.RequestShares(8))  # 4 for one client
    config, where = _tcp_daemon(tmp_path / "a.log")
    with running(uvicorn.Server(config)), _client(where, "127.0.0.1") as mine, \
            _client(where, "127.0.0.2") as theirs:
        held = [_started_exec(where, "127.0.0.1") for _ in range(4)]
        try:
            wait_until("four execs wait on the guest", lambda: len(guest.requests) == 4, PATIENCE_S)
            r = mine.get("/v1/sandboxes")
            message = _error(r, 429)
            assert r.headers["retry-after"] == "1"
            assert "this client (127.0.0.1) has 4 requests in flight" in message, message
            assert "at most 4 at once" in message and "app.WORKERS" in message, message
            assert theirs.get("/v1/sandboxes").status_code == 200  # another client is served
        finally:
            for conn in held:
                conn.close()
        wait_until("the execs ended", lambda: app.REQUESTS.held == 0, PATIENCE_S)
        assert app.REQUESTS.by_client == {}
        assert mine.get("/v1/sandboxes").status_code == 200


def test_the_daemons_workers_are_what_its_requests_are_bounded_by(
        tmp_path: Path) -> None:
    """The thread pool the handlers run in is WORKERS threads, set at start-up."""
    import anyio

    async def limiter_after_startup() -> float:
        ctl_app = _daemon_app(tmp_path)
        for hook in ctl_app.on_startup:
            hook()
        return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert anyio.run(limiter_after_startup) == app.WORKERS == app.REQUESTS.total
