"""The controller against the third hostile review: what a client that goes away leaves
behind, and what the routes and tools refuse.

A sandbox here is the real guest agent run on the host (tests/engine/agent_harness.py)
behind the real relay, with a child record whose "QEMU" is a process this test starts
(its command line names the child's directory, as QEMU's does); the daemon is the real
app with the real LocalBackend on uvicorn, reached by the real RemoteBackend. No VM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from agent_harness import host_agent

from forkd.audit import AuditLog
from forkd.controller import app, client
from forkd.controller.api import ExecRequest
from forkd.controller.backend import LocalBackend
from forkd.engine import children as ch
from forkd.engine.lifecycle import ChildInfo
from forkd.engine.paths import children_dir
from forkd.store.store import Store

CHILD = "hostile-ab12cd"


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait(what: str, ok: object, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A daemon on a Unix socket serving one sandbox, CHILD, whose agent runs on the host."""
    short = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))  # sockets' paths fit 108 bytes
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(short / "run"))
    d = children_dir() / CHILD
    d.mkdir()
    qemu = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                             str(d / "qmp.sock")], start_new_session=True)
    try:
        with host_agent(d):
            ChildInfo(id=CHILD, ref="tiny:latest", digest="sha256:" + "0" * 64, pid=qemu.pid,
                      dir=str(d), memory=str(d / "mem"), disk_backing="-", memory_mib=128,
                      created=time.time()).save()
            sock = short / "ctl.sock"
            the_app = app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                                     app.ControllerMetrics(), None)
            server = uvicorn.Server(uvicorn.Config(the_app, uds=str(sock),
                                                   log_level="critical"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            _wait("uvicorn did not start", lambda: server.started)
            try:
                yield short
            finally:
                server.should_exit = True
                thread.join(15)
    finally:
        qemu.kill()
        qemu.wait()
        shutil.rmtree(short, ignore_errors=True)
    _wait("a request to the guest outlived the test", lambda: not ch._in_flight)


def _started(pidfile: Path) -> int:
    _wait("the command did not start", lambda: pidfile.exists() and pidfile.read_text().strip())
    return int(pidfile.read_text())


@contextlib.contextmanager
def _request(sock: Path, method: str, url: str, body: bytes = b"") -> Iterator[socket.socket]:
    """An HTTP request sent on a connection of its own, which is closed (the client goes
    away) when the block ends, whatever was read of the answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(sock))
    head = (f"{method} {url} HTTP/1.1\r\nHost: forkd\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    conn.sendall(head + body)
    try:
        yield conn
    finally:
        conn.close()


@pytest.mark.parametrize("prints", [True, False], ids=["printing", "silent"])
def test_a_streamed_command_whose_reader_left_is_killed_and_frees_its_request(
    daemon: Path, prints: bool
) -> None:
    """The command of a stream whose client went away ran on to its end: with no timeout,
    for ever, holding one of the daemon's MAX_REQUESTS guest requests (32: that many
    abandoned streams and every exec, eval and file request of the daemon was Busy) and a
    thread. A silent one was not even noticed (its producer waited for output that never
    came). Now it is killed with its group within a second or two, and its request freed."""
    pidfile = daemon / "pid"
    script = f"echo $$ > {pidfile}; " + ("while :; do echo tick; sleep 0.2; done"
                                          if prints else "exec sleep 300")
    body = json.dumps({"argv": ["sh", "-c", script]}).encode()
    with _request(daemon / "ctl.sock", "POST", f"/v1/sandboxes/{CHILD}/exec/stream",
                  body) as conn:
        pid = _started(pidfile)
        if prints:
            conn.settimeout(15)
            assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        assert ch._in_flight == {CHILD: 1}
    try:
        _wait(f"the command of an abandoned stream still runs (pid {pid})", lambda: _gone(pid))
        _wait("the abandoned stream still holds its guest request", lambda: not ch._in_flight)
    finally:  # the command this test started, if the check failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_a_stream_read_to_its_end_is_whole_and_cut_in_bounded_frames(daemon: Path) -> None:
    """A line far longer than a frame (1 MiB, no newline, and a 3-byte character right at
    the cut) arrives as frames of at most STREAM_FRAME_CHARS that reassemble exactly."""
    from forkd.controller.backend import STREAM_FRAME_CHARS

    line = "a" * (STREAM_FRAME_CHARS - 1) + "\u20ac" + "b" * (1 << 20)
    source = daemon / "line"
    source.write_text(line)
    remote = client.RemoteBackend(socket=daemon / "ctl.sock")
    try:
        frames = list(remote.exec_stream(CHILD, ExecRequest(argv=["cat", str(source)])))
    finally:
        remote.close()
    out = [f.stdout for f in frames if f.stdout]
    assert "".join(out) == line
    assert max(len(piece) for piece in out) <= STREAM_FRAME_CHARS
    assert frames[-1].result is not None and frames[-1].result.exit_code == 0


def test_a_file_read_whose_reader_left_while_no_chunk_came_ends(daemon: Path) -> None:
    """A FIFO nobody writes gives no chunk: the transfer waited for one for ever, its
    request held, after its reader left. Now the answer starts after FIRST_CHUNK_WAIT_S
    and the transfer ends once the reader leaves."""
    fifo = daemon / "fifo"
    os.mkfifo(fifo)
    url = f"/v1/sandboxes/{CHILD}/files?path={fifo}"
    with _request(daemon / "ctl.sock", "GET", url) as conn:
        _wait("the read did not reach the guest", lambda: ch._in_flight == {CHILD: 1})
        conn.settimeout(app.FIRST_CHUNK_WAIT_S + 15)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")  # the answer starts anyway
    _wait("the abandoned file read still holds its guest request", lambda: not ch._in_flight)
    with open(fifo, "wb", buffering=0) as w, contextlib.suppress(BrokenPipeError):
        w.write(b"x")  # the guest's own read of the FIFO ends too


# -- MCP over HTTP: every tool needs the token, and no scope goes around it ---------------

MCP_TOKEN = b"mcp-review3-token-0123456789-0123456789-0123456789"


def test_mcp_http_refuses_any_scope_but_lifespan_without_the_token() -> None:
    """BearerAuth checked only ``http`` scopes and passed every other one to the MCP app
    untouched: a WebSocket (or a scope type an ASGI server adds) reached the app without
    the token. Now only lifespan passes; a WebSocket needs the token like HTTP."""
    import asyncio

    from forkd.controller.app import Token
    from forkd.controller.mcp import BearerAuth

    reached: list[str] = []
    sent: list[dict[str, object]] = []

    async def inner(scope: dict[str, object], receive: object, send: object) -> None:
        reached.append(str(scope["type"]))

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "websocket.connect"}

    guard = BearerAuth(inner, Token(MCP_TOKEN))
    bearer = [(b"authorization", b"Bearer " + MCP_TOKEN)]
    wrong = [(b"authorization", b"Bearer " + b"x" * 43)]

    async def main() -> None:
        for kind, headers in [("websocket", []), ("websocket", wrong), ("http.future", []),
                              ("webtransport", bearer)]:
            await guard({"type": kind, "headers": headers, "path": "/mcp"}, receive, send)
        assert reached == [], reached
        assert sent[:2] == [{"type": "websocket.close", "code": 1008}] * 2
        await guard({"type": "websocket", "headers": bearer, "path": "/mcp"}, receive, send)
        await guard({"type": "lifespan"}, receive, send)
        assert reached == ["websocket", "lifespan"]

    asyncio.run(main())


def test_every_mcp_tool_over_http_needs_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enumerated from the server itself (a tool added later is asked too): a call of each
    tool without the token, with a wrong one, with another scheme or with two Authorization
    headers is a 401, and no tool runs (nothing is written to the store)."""
    import asyncio

    import httpx

    from forkd.controller.app import Token
    from forkd.controller.mcp import TOOL_NAMES, BearerAuth, build_server
    from forkd.controller.sdk import Controller

    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    short = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))
    monkeypatch.setenv("FORKD_RUN", str(short / "run"))
    server = build_server(Controller(local=True))
    names = sorted(t.name for t in asyncio.run(server.list_tools()))
    assert names == sorted(TOOL_NAMES)
    the_app = BearerAuth(server.streamable_http_app(streamable_http_path="/mcp",
                                                    host="127.0.0.1"), Token(MCP_TOKEN))
    sock = short / "mcp.sock"
    web = uvicorn.Server(uvicorn.Config(the_app, uds=str(sock), log_level="critical"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        _wait("uvicorn did not start", lambda: web.started)
        bad: list[list[tuple[str, str]]] = [
            [], [("Authorization", "Bearer " + "x" * 43)],
            [("Authorization", "Basic " + MCP_TOKEN.decode())],
            [("Authorization", MCP_TOKEN.decode())],
            [("Authorization", "Bearer " + MCP_TOKEN.decode()), ("Authorization", "Bearer x")],
        ]
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://127.0.0.1") as http:
            for name in names:
                call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                        "params": {"name": name, "arguments": {"tag": "tiny", "sandbox_id":
                                                               "x-1", "path": "/etc/passwd"}}}
                for headers in bad:
                    r = http.post("/mcp", json=call, headers=headers, timeout=10)
                    assert r.status_code == 401, (name, headers, r.status_code, r.text)
                    assert r.headers["www-authenticate"].startswith("Bearer")
    finally:
        web.should_exit = True
        thread.join(15)
        shutil.rmtree(short, ignore_errors=True)
    assert not (tmp_path / "home").exists() or not list((tmp_path / "home").rglob("*.json"))


def test_a_pool_tag_is_checked_and_shortened_with_or_without_a_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE /v1/pools/TAG of a controller without pools answered 404 with the caller's
    tag repeated raw (a NUL, 16 KiB of it); a daemon with pools answered 400. Every route
    that takes a tag now checks it first: the same 400, the tag shortened."""
    from litestar.testing import TestClient

    from forkd.engine.pool import Pool

    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    store = Store.open()
    answers = []
    for pool in (None, Pool(store)):
        backend = LocalBackend(store, pool)
        the_app = app.create_app(backend, AuditLog(tmp_path / "a.log"), app.ControllerMetrics(),
                                 None)
        with TestClient(the_app) as http:
            for tag in ("x%00y", "A" * 8000):
                r = http.delete(f"/v1/pools/{tag}")
                answers.append((r.status_code, r.json()["error"]["type"]))
                assert len(r.text) < 1000 and "\\u0000" not in r.text, r.text[:200]
            r = http.delete("/v1/pools/tiny:nope")
            assert r.status_code == 404 and "tiny:nope" in r.text
        backend.close()
    assert set(answers) == {(400, "InvalidInput")}
