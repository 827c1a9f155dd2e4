"""The controller against the fourth hostile review: what a slow or greedy client holds
of a listener (server.BoundedProtocol, applied by server.bounded_config to the Unix
socket, TCP and `forkd mcp --transport http`), MCP sessions, and guest text that reaches
messages (names.inert). No VM: the real app and protocols on uvicorn, with short limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from daemon_support import MCP_HELLO, mcp_auth, mcp_sessions, running, slow_app
from net_support import PATIENCE_S, free_port

from forkd.audit import AuditLog
from forkd.controller import app, server
from forkd.controller.backend import LocalBackend
from forkd.names import inert
from forkd.store.store import Store

TOKEN = b"t" * 43
QUICK = server.Limits(head_timeout_s=0.5, max_connections=3, stall_timeout_s=1.0)
# A cut comes at QUICK's 0.5 s; the bound tells it from the default 10 s
# (server.HEAD_TIMEOUT_S) with room for a loaded machine (it was 3 s).
CUT_BY_S = 8.0
assert CUT_BY_S < server.HEAD_TIMEOUT_S


@pytest.fixture
def unix(place: Path, tmp_path: Path) -> Iterator[Path]:
    """The daemon's Unix-socket app and protocol, with QUICK limits."""
    sock = place / "ctl.sock"
    the_app = app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                             app.ControllerMetrics(), None)
    config = server.bounded_config(the_app, server.UnixPeerProtocol, QUICK, uds=str(sock))
    with running(uvicorn.Server(config)):
        yield sock


@pytest.fixture
def tcp(place: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The daemon's TCP app (token TOKEN) and protocol, with QUICK limits."""
    port = free_port()
    the_app = app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                             app.ControllerMetrics(), TOKEN)
    config = server.bounded_config(the_app, server.BoundedProtocol, QUICK,
                                   host="127.0.0.1", port=port)
    with running(uvicorn.Server(config)):
        yield ("127.0.0.1", port)


def _connect(where: Path | tuple[str, int]) -> socket.socket:
    family = socket.AF_UNIX if isinstance(where, Path) else socket.AF_INET
    conn = socket.socket(family, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(str(where) if isinstance(where, Path) else where)
    return conn


def _drip_until_closed(
    conn: socket.socket, data: bytes, seconds: float = PATIENCE_S
) -> tuple[float, bytes]:
    """Send ``data`` a byte every 50 ms (and then nothing) until the server closes the
    connection; how long that took and what it answered. A server that keeps it open for
    ``seconds`` (by the clock, not by sleeps counted) fails the test."""
    start = time.monotonic()
    got = b""
    conn.setblocking(False)
    i = -1
    while time.monotonic() - start < seconds:
        i += 1
        with contextlib.suppress(BlockingIOError):
            chunk = conn.recv(65536)
            if not chunk:
                return time.monotonic() - start, got
            got += chunk
        if i < len(data):
            try:
                conn.send(data[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start, got
        time.sleep(0.05)
    raise AssertionError(f"still open after {seconds} s; answered {got[:200]!r}")


def _answer(conn: socket.socket, request: bytes) -> bytes:
    """Send ``request`` whole; the first answer that arrives (one recv's worth)."""
    conn.sendall(request)
    return conn.recv(65536)


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: forkd\r\n\r\n"


def test_a_head_sent_byte_by_byte_is_cut_at_the_deadline(unix: Path) -> None:
    """A slowloris client: bytes keep arriving, the head never ends. It held a connection
    (and one of the listener's 256) for as long as it kept sending."""
    endless = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 2000
    took, got = _drip_until_closed(_connect(unix), endless)
    assert took < CUT_BY_S, took
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"did not arrive whole within 0.5 s" in got


def test_a_connection_that_never_sends_is_closed(tcp: tuple[str, int]) -> None:
    took, got = _drip_until_closed(_connect(tcp), b"")
    assert took < CUT_BY_S and got == b"", (took, got)


def test_after_a_401_a_dripped_body_does_not_hold_the_connection(tcp: tuple[str, int]) -> None:
    """The 401 answers before the body is read; uvicorn then read the rest of the body for
    as long as it came (its keep-alive timer is reset by every byte)."""
    conn = _connect(tcp)
    head = (b"POST /v1/pools HTTP/1.1\r\nHost: forkd\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    got = _answer(conn, head)
    assert got.startswith(b"HTTP/1.1 401"), got
    took, _ = _drip_until_closed(conn, b" " * 2000)
    assert took < CUT_BY_S, took


def test_a_kept_alive_connection_must_send_its_next_head_in_time(unix: Path) -> None:
    conn = _connect(unix)
    assert _answer(conn, HEALTH).startswith(b"HTTP/1.1 200")
    assert _answer(conn, HEALTH).startswith(b"HTTP/1.1 200")  # keep-alive still works
    took, _ = _drip_until_closed(conn, b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 200)
    assert took < CUT_BY_S, took


def test_a_body_that_trickles_while_the_app_waits_is_cut(unix: Path) -> None:
    """Before: the app waited for the body as long as a byte came now and then."""
    conn = _connect(unix)
    conn.sendall(b"POST /v1/pools HTTP/1.1\r\nHost: forkd\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100000\r\n\r\n{")
    took, _ = _drip_until_closed(conn, b" " * 2000)
    assert took < CUT_BY_S, took


def test_a_whole_body_sent_at_once_is_served(unix: Path) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(unix)),
                      base_url="http://forkd") as http:
        r = http.post("/v1/pools", json={"tag": "nope:latest", "k": 1, "pad": "x" * 50_000})
    assert r.status_code == 400, r.text  # the body arrived and was judged


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_past_the_connection_limit_a_client_gets_503_and_a_freed_slot_serves(
    listener: str, request: pytest.FixtureRequest
) -> None:
    where = request.getfixturevalue(listener)
    held = [_connect(where) for _ in range(QUICK.max_connections)]
    time.sleep(0.1)
    extra = _connect(where)
    got = _answer(extra, HEALTH)
    assert got.startswith(b"HTTP/1.1 503"), got
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert "limit of 3 open connections" in body["error"]["message"]
    assert extra.recv(100) == b""  # closed after the answer
    held.pop().close()
    # The server frees the slot when it notices the close (was: 0.2 s later, asked once).
    deadline = time.monotonic() + PATIENCE_S
    while not (got := _answer(_connect(where), HEALTH)).startswith(b"HTTP/1.1 200"):
        assert got.startswith(b"HTTP/1.1 503"), got
        assert time.monotonic() < deadline, f"the freed slot never served: {got!r}"
        time.sleep(0.05)
    for conn in held:
        conn.close()


def test_no_websocket_upgrade_leaves_the_protocol(unix: Path) -> None:
    """An upgraded connection leaves uvicorn's connection set and the h11 protocol (and so
    every bound above); bounded_config turns upgrades off: it is plain HTTP."""
    conn = _connect(unix)
    got = _answer(conn, b"GET /healthz HTTP/1.1\r\nHost: forkd\r\nConnection: Upgrade\r\n"
                        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200"), got


def test_an_answer_the_client_does_not_read_ends_the_connection(place: Path) -> None:
    """A client that stops reading a large answer held its connection (and the handler's
    memory) for ever: writing stayed paused. Now it ends after stall_timeout_s."""
    sent = threading.Event()
    ended = threading.Event()

    async def endless(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Sends until the server says the client is gone (as Litestar's Stream does)."""
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})

        async def write() -> None:
            while True:
                await send({"type": "http.response.body", "body": b"x" * 65536,
                            "more_body": True})
                sent.set()
                await asyncio.sleep(0)  # a real source waits for its next piece

        writer = asyncio.ensure_future(write())
        while (await receive())["type"] != "http.disconnect":
            pass
        writer.cancel()
        ended.set()

    sock = place / "stall.sock"
    config = server.bounded_config(endless, server.BoundedProtocol, QUICK, uds=str(sock))
    with running(uvicorn.Server(config)):
        conn = _connect(sock)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(HEALTH)
        assert sent.wait(PATIENCE_S)
        assert ended.wait(PATIENCE_S), "the answer nobody reads still runs"
        conn.close()


def test_mcp_http_is_bounded_and_its_sessions_are_limited_and_expire(place: Path) -> None:
    """`forkd mcp --transport http` served with uvicorn's defaults: no head deadline, and
    MCP sessions without a bound (the SDK's 10,000) that lived for 30 minutes."""
    from forkd.controller.mcp import http_server
    from forkd.controller.sdk import Controller

    port = free_port()
    web = http_server(Controller(local=True), "127.0.0.1", port, "/mcp", app.Token(TOKEN),
                      limits=QUICK, max_sessions=2, session_idle_s=1.0)
    auth, hello = mcp_auth(TOKEN), MCP_HELLO
    with running(web):
        took, _ = _drip_until_closed(_connect(("127.0.0.1", port)), b"POST /mcp HTTP/1.1\r\n")
        assert took < CUT_BY_S, took
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            ids = mcp_sessions(http, 2, TOKEN)
            r = http.post("/mcp", json=hello, headers=auth)
            assert r.status_code == 503 and "Too many open sessions" in r.text, r.text
            # Both idle past session_idle_s: closed, their slots free. Was: 2 s later, one
            # ping; on a loaded machine the close could come later (and a ping to a session
            # still open restarts its idle time). New sessions touch neither: wait until
            # two are let in, both slots freed, so both old sessions were closed.
            deadline = time.monotonic() + PATIENCE_S
            for _ in range(2):
                while (r := http.post("/mcp", json=hello, headers=auth)).status_code != 200:
                    assert r.status_code == 503 and "Too many open sessions" in r.text, r.text
                    assert time.monotonic() < deadline, "idle sessions were not closed"
                    time.sleep(0.1)
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            for sid in ids:
                r = http.post("/mcp", json=ping, headers={**auth, "mcp-session-id": sid})
                assert r.status_code == 404, r.text


# -- guest text in messages (names.inert) ------------------------------------------
HOSTILE = ("refused\x1b[2J\x1b[H\x1b]0;owned\x07\x1b]8;;https://evil\x1b\\link\x1b]8;;\x1b\\"
           "\x9b31m\x9d52;c;QUJD\x9c\rmasked\u202etxt.exe\u2066\x00\x7f\udcff")
ACTS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                  "\u2066-\u2069\ud800-\udfff]")


def _obeys_nothing(text: str) -> None:
    assert not ACTS.search(text), repr(text)
    text.encode()  # no lone surrogate: a terminal write cannot fail on it


def test_inert_shows_every_control_and_keeps_the_rest() -> None:
    controls = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x61C, 0x200E, 0x200F,
                                 0x2028, 0x2029, *range(0x202A, 0x202F),
                                 *range(0x2066, 0x206A), 0xD800, 0xDFFF]))
    shown = inert(controls + HOSTILE)
    _obeys_nothing(shown)
    assert "\\x1b[2J" in shown and "\\u202e" in shown and "\\x9b" in shown
    assert "\n" in shown and "\t" in shown  # lines and tabs stay
    plain = "ünïcode ✓ 中文 emoji 👍 line\nnext\ttab"
    assert inert(plain) == plain
    assert inert("a\r\nb") == "a\nb"
    long = inert("a" * 3000 + HOSTILE * 100 + "z" * 3000)
    assert len(long) <= 4000 and long.startswith("a") and long.endswith("z")
    assert "characters cut" in long and inert(long) == long  # once is enough


def test_a_guest_agents_refusal_is_inert_in_the_error() -> None:
    from forkd.engine import agent_client
    from forkd.engine.errors import AgentError
    from forkd.errors import Conflict, NotFound

    for kind, family in [("not_found", NotFound), ("state", Conflict), ("other", AgentError)]:
        with pytest.raises(family) as caught:
            agent_client._raise_for("exec", {"error": {"type": kind, "message": HOSTILE * 500}})
        _obeys_nothing(str(caught.value))
        assert len(str(caught.value)) < 2100


def test_a_console_tail_in_an_error_is_inert(tmp_path: Path) -> None:
    from forkd.engine.egress import child
    from forkd.engine.qemu import QemuVM

    raw = HOSTILE.encode(errors="surrogateescape")  # as a guest writes it: any bytes
    (tmp_path / child.LOG_FILE).write_bytes(raw)
    _obeys_nothing(child.log_tail(tmp_path))
    vm = QemuVM.__new__(QemuVM)  # only what log_tail reads: the log files, no process
    vm.proc, vm.qmp, vm.dir = None, None, tmp_path
    (tmp_path / "serial.log").write_bytes(b"boot\n" + raw)
    tail = vm.log_tail()
    _obeys_nothing(tail)
    assert "masked" in tail


def test_every_error_answer_tool_error_and_cli_error_is_inert() -> None:
    """The sinks: whatever error reaches them (an engine error built before inert existed,
    a backend's, a remote daemon's), the client, the agent and the terminal get it inert."""
    import click
    from click.testing import CliRunner
    from mcp.server.mcpserver.exceptions import ToolError

    from forkd.cli.errors import ForkdGroup
    from forkd.controller.mcp import tool_errors
    from forkd.engine.errors import AgentError

    for exc in (AgentError(HOSTILE), RuntimeError(HOSTILE)):
        _status, body = app.error_answer(exc)
        if isinstance(exc, AgentError):
            assert "masked" in body.message
        _obeys_nothing(body.message)

        @tool_errors
        def tool(exc: Exception = exc) -> None:
            raise exc

        with pytest.raises(ToolError) as caught:
            tool()
        _obeys_nothing(str(caught.value))

    @click.group(cls=ForkdGroup)
    def cli() -> None:
        pass

    @cli.command()
    def boom() -> None:
        raise AgentError(HOSTILE)

    result = CliRunner().invoke(cli, ["boom"])
    assert result.exit_code == AgentError.exit_code
    assert "forkd: error: refused" in result.output
    _obeys_nothing(result.output.replace("\n", " "))


# -- a token revoked while a request runs ----------------------------------------------
@pytest.mark.parametrize("answer", ["streaming", "not-started"])
def test_a_revoked_token_ends_the_requests_it_let_in(place: Path, answer: str) -> None:
    """The token was checked once, when a request began: a stream (exec output, a file, an
    MCP event stream) went on after the token file was replaced, for as long as the
    client read. Now TokenWatch (TCP and `forkd mcp` HTTP) ends it within a recheck."""
    from test_daemon_security import _private_token_file, _replace_private_file

    old, new = "o" * 43, "n" * 43
    token = server.load_token(_private_token_file(place / "token", old))

    entered = threading.Event()
    revoked_at: list[float] = []

    async def endless(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        entered.set()
        if answer == "not-started":
            await asyncio.sleep(3600)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(0.05)

    port = free_port()
    watched = app.TokenWatch(endless, token, every=0.1)
    config = server.bounded_config(watched, limits=QUICK, host="127.0.0.1", port=port)

    def revoke() -> None:
        """Once the request is in the app (was: 0.5 s after it was sent, which a loaded
        machine could reach before the request did: a plain 401, no stream)."""
        if entered.wait(PATIENCE_S):
            time.sleep(0.3)  # a stream under way
            _replace_private_file(place / "token", new)
            revoked_at.append(time.monotonic())

    def since_revoked() -> float:
        return time.monotonic() - revoked_at[0] if revoked_at else 0.0

    revoker = threading.Thread(target=revoke)
    with running(uvicorn.Server(config)), httpx.Client(timeout=PATIENCE_S) as http:
        revoker.start()
        with http.stream("GET", f"http://127.0.0.1:{port}/",
                         headers={"Authorization": f"Bearer {old}"}) as r:
            if answer == "not-started":
                assert r.status_code == 401, r.status_code
                assert b"revoked while this request ran" in r.read()
            else:
                assert r.status_code == 200, r.status_code
                with pytest.raises(httpx.RemoteProtocolError):
                    for _ in r.iter_bytes():
                        assert since_revoked() < CUT_BY_S, "the stream outlived its token"
            assert revoked_at and since_revoked() < CUT_BY_S
        revoker.join(PATIENCE_S)


def test_a_body_the_app_does_not_take_yet_is_not_cut(place: Path) -> None:
    """The body-progress bound is the client's pace: while uvicorn stops reading (the app
    has not taken the first 64 KiB), a slow handler's request is not cut."""
    slow = slow_app(1.5)  # three body windows without reading the body
    sock = place / "slow.sock"
    config = server.bounded_config(slow, server.BoundedProtocol, QUICK, uds=str(sock))
    with running(uvicorn.Server(config)):
        conn = _connect(sock)
        body = b"x" * (8 << 20)  # more than the socket holds: the rest waits for the app
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        def send_all() -> None:
            with contextlib.suppress(OSError):  # answered unread, the rest is refused
                conn.sendall(head + body)

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        got = conn.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got
