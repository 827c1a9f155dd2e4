"""The controller against the ninth hostile review: `forkd mcp --transport http` in front
of a daemon, where every MCP client is the same client of the daemon. No VM: the real
apps and protocols on uvicorn, and a fake guest agent (daemon_support.FakeGuest)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import daemon_support
import httpx
import pytest
import uvicorn
from daemon_support import FakeEngine, FakeGuest, SlowEngine, running
from net_support import PATIENCE_S, free_port, wait_until

from forkd.audit import AuditLog
from forkd.controller import app, server
from forkd.controller.backend import LocalBackend
from forkd.engine import children as ch
from forkd.store.store import Store

TOKEN = b"t" * 43


def _daemon_app(tmp_path: Path) -> Any:
    return app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                          app.ControllerMetrics(), None)


@contextlib.contextmanager
def _mcp_on_daemon(place: Path, tmp_path: Path, **options: Any) -> Iterator[str]:
    """`forkd mcp --transport http` (its URL, ``options`` of mcp.http_server) whose tools
    go to a daemon on its socket."""
    from forkd.controller.mcp import SandboxScope, http_server
    from forkd.controller.sdk import Controller

    sock = place / "ctl.sock"
    daemon = server.bounded_config(_daemon_app(tmp_path), server.UnixPeerProtocol,
                                   uds=str(sock))
    port = free_port()
    with running(uvicorn.Server(daemon)):
        web = http_server(Controller(socket=sock, local=False), "127.0.0.1", port, "/mcp",
                          app.Token(TOKEN), scope=SandboxScope(everything=True), **options)
        with running(web):
            yield f"http://127.0.0.1:{port}"


@pytest.fixture
def mcp_on_daemon(place: Path, tmp_path: Path) -> Iterator[str]:
    with _mcp_on_daemon(place, tmp_path) as url:
        yield url


class McpClient(daemon_support.McpClient):
    """One MCP client (its own source address) with a session, calling tools."""

    def __init__(self, url: str, source: str) -> None:
        super().__init__(url, TOKEN, source)

    def call(self, tool: str, **arguments: Any) -> str:
        """The tool's answer (the SSE text of its result)."""
        return self.tool_text(tool, **arguments)

    def call_in_background(self, tool: str, **arguments: Any) -> None:
        def run() -> None:
            with contextlib.suppress(httpx.HTTPError):  # cut when the server stops
                self.call(tool, **arguments)

        threading.Thread(target=run, daemon=True).start()


def test_one_mcp_client_cannot_take_every_guest_request_of_the_mcp_server(
        mcp_on_daemon: str, guest: FakeGuest, request: pytest.FixtureRequest) -> None:
    """Before: in front of a daemon, `forkd mcp --transport http` is one client of the
    daemon (its uid), whatever MCP client calls a tool, so the daemon's per-client share of
    guest requests (16) was one share for all of them: one MCP client running 16 commands
    that wait (in 16 sandboxes) left every other MCP client's run_command a
    TooManyRequests from the daemon. Now: the MCP server keeps its own per-client share
    of tool calls in flight, half of what it may have in flight itself (in front of a
    daemon, the daemon's share of one client), so one MCP client's 9th call waiting at
    once is refused saying so, and another client's command still runs."""
    from forkd.controller import mcp

    share = mcp.ToolCalls.for_daemon().share
    mine = McpClient(mcp_on_daemon, "127.0.0.1")
    request.addfinalizer(mine.http.close)  # its calls' connections: their commands end
    for i in range(share):
        mine.call_in_background("run_command", sandbox_id=f"sb-{i}", command=["sleep", "1000"])
    wait_until("the guest has my commands", lambda: len(guest.requests) == share, PATIENCE_S)
    refused = mine.call("run_command", sandbox_id="sb-x", command=["sleep", "1000"])
    assert '"isError":true' in refused, refused
    assert "TooManyRequests" in refused and "127.0.0.1" in refused, refused
    assert f"{share} tool calls in flight" in refused, refused
    assert len(guest.requests) == share  # the refused one never reached the guest
    theirs = McpClient(mcp_on_daemon, "127.0.0.2")
    request.addfinalizer(theirs.http.close)
    theirs.call_in_background("run_command", sandbox_id="sb-y", command=["true"])
    wait_until("the other client's command reached the guest",
               lambda: len(guest.requests) == share + 1, 10)
    assert guest.requests[-1]["argv"] == ["true"]


@pytest.fixture
def mcp_in_process(place: Path) -> Iterator[str]:
    """`forkd mcp --transport http` with the engine in its own process (its URL)."""
    from forkd.controller.mcp import SandboxScope, http_server
    from forkd.controller.sdk import Controller

    port = free_port()
    with running(http_server(Controller(local=True), "127.0.0.1", port, "/mcp",
                             app.Token(TOKEN), scope=SandboxScope(everything=True))):
        yield f"http://127.0.0.1:{port}"


CALLS = [("run_command", {"command": ["sleep", "1000"]}),
         ("run_code", {"code": "import time; time.sleep(1000)", "timeout_s": 2000}),
         ("read_file", {"path": "/tmp/fifo"})]  # the fake guest never answers: a FIFO


@pytest.mark.parametrize("how", ["cancelled", "session ended"])
@pytest.mark.parametrize(("tool", "arguments"), CALLS)
@pytest.mark.parametrize("where", ["mcp_in_process", "mcp_on_daemon"])
def test_a_cancelled_tool_call_stops_what_it_runs(
        where: str, tool: str, arguments: dict[str, Any], how: str, guest: FakeGuest,
        request: pytest.FixtureRequest) -> None:
    """Before: an MCP client that cancelled a call (``notifications/cancelled``, as the
    spec has it: the server should stop the work) got no answer, but the tool went on in
    its worker thread (the SDK cannot cancel a thread), and so it did when the client
    ended its session (DELETE), so the command or cell ran in the
    sandbox to its end, a command without a timeout for ever, holding its guest request
    (and the client's share of them) for a call nobody waits for. Now: the cancellation
    stops it as a revocation does, in process or through the daemon, and the share is
    given back."""
    url = request.getfixturevalue(where)
    client = McpClient(url, "127.0.0.1")
    request.addfinalizer(client.http.close)
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": tool, "arguments": {"sandbox_id": "sb-1", **arguments}}}

    def call() -> None:
        with contextlib.suppress(httpx.HTTPError):
            client.http.post("/mcp", json=body, headers=client.session)

    threading.Thread(target=call, daemon=True).start()
    wait_until("the guest has the request", lambda: len(guest.requests) == 1, PATIENCE_S)
    if how == "cancelled":
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 7, "reason": "the user pressed stop"}}
        r = client.http.post("/mcp", json=cancel, headers=client.session)
        assert r.status_code == 202, r.text
    else:
        assert client.http.delete("/mcp", headers=client.session).status_code < 300
    # within a second; a file read through the daemon within its first chunk's wait too
    # (the daemon learns its client left once the answer starts: app.FIRST_CHUNK_WAIT_S)
    assert guest.closed.wait(10), f"the cancelled {tool} still runs in the sandbox"
    wait_until("the guest request given back", lambda: not ch._in_flight, PATIENCE_S)


@pytest.fixture
def mcp_sharing_two(place: Path, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FakeEngine]]:
    """`forkd mcp --transport http` in front of a daemon whose engine forks at once (no VM),
    each MCP client running at most 2 sandboxes through it (its URL, the engine)."""
    from forkd.controller.mcp import SandboxShares

    engine = FakeEngine()
    monkeypatch.setattr(ch, "fork", engine.fork)
    monkeypatch.setattr(ch, "list_children", engine.list_children)
    with _mcp_on_daemon(place, tmp_path, sandboxes=SandboxShares(2)) as url:
        yield url, engine


def test_one_mcp_client_cannot_take_every_sandbox_the_daemon_gives_the_mcp_server(
        mcp_sharing_two: tuple[str, FakeEngine], request: pytest.FixtureRequest) -> None:
    """Before: in front of a daemon every MCP client is the same client of the daemon, so
    the daemon's per-client share of VMs (half its --max-sandboxes) was one share for all
    of them: one MCP client's create_sandboxes took all of it, and every other MCP client
    was refused until it killed some. Now each MCP client runs at most its share of
    sandboxes through the MCP server (mcp.SandboxShares): past it a tool error says whose
    share and what to do, the other clients keep theirs, and a sandbox that ended gives
    its place back."""
    url, engine = mcp_sharing_two
    mine, theirs = McpClient(url, "127.0.0.1"), McpClient(url, "127.0.0.2")
    request.addfinalizer(mine.http.close)
    request.addfinalizer(theirs.http.close)
    made = mine.call("create_sandboxes", tag="tiny", n=2)
    assert '"isError":false' in made and "sb-2" in made, made
    for n in (1, 2):
        refused = mine.call("create_sandboxes", tag="tiny", n=n)
        assert '"isError":true' in refused and "TooManyRequests" in refused, refused
        assert "this client (127.0.0.1) runs 2" in refused, refused
        assert "one MCP client runs at most 2" in refused and "kill_sandbox" in refused
    assert engine.forks == 2  # the refused ones never reached the daemon
    theirs_made = theirs.call("create_sandboxes", tag="tiny", n=2)
    assert '"isError":false' in theirs_made, theirs_made  # their share was kept for them
    engine.end("sb-1")  # one of mine ended: room for one more of mine, not two
    assert '"isError":true' in mine.call("create_sandboxes", tag="tiny", n=2)
    again = mine.call("create_sandboxes", tag="tiny", n=1)
    assert '"isError":false' in again, again
    assert engine.forks == 5


@pytest.mark.parametrize("where", ["mcp_in_process", "mcp_on_daemon"])
def test_a_create_cancelled_while_its_sandboxes_start_leaves_none_running(
        where: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Before: a create_sandboxes cancelled while its sandboxes started (a slow fork, a
    lazy one from a far hub) got no answer, but the spawn went on and its sandboxes ran,
    with no timeout for ever, their ids told to nobody (and, through a daemon, counted
    against the MCP server's share of its VMs). Now the call's stop reaches the spawn: they
    are killed, in process by the tool, through a daemon by the daemon (app.unclaimed)."""
    engine = SlowEngine()
    monkeypatch.setattr(ch, "fork", engine.fork)
    monkeypatch.setattr(ch, "list_children", engine.list_children)
    monkeypatch.setattr(ch, "kill", engine.kill)
    client = McpClient(request.getfixturevalue(where), "127.0.0.1")
    request.addfinalizer(client.http.close)
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
            "params": {"name": "create_sandboxes", "arguments": {"tag": "slow:x", "n": 2}}}

    def call() -> None:
        with contextlib.suppress(httpx.HTTPError):
            client.http.post("/mcp", json=body, headers=client.session)

    threading.Thread(target=call, daemon=True).start()
    assert engine.forking.wait(30)
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
              "params": {"requestId": 9, "reason": "the user pressed stop"}}
    assert client.http.post("/mcp", json=cancel, headers=client.session).status_code == 202
    assert engine.forked.wait(30)
    wait_until("the cancelled create's sandboxes killed", lambda: engine.children == [], 30)
    assert sorted(engine.killed) == ["sb-1", "sb-2"]
