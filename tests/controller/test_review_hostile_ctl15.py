"""The MCP server against the fifteenth hostile review: what a client that goes away
leaves behind, and what a check made before an act lets another client change. No VM: the
real apps and protocols on uvicorn (`forkd mcp --transport http` in front of the daemon on
its socket), the engine's fork, list and kill standing in (daemon_support.FakeEngine: the
daemon's handlers and admission run for real), the engine's branch standing in where a
branch is made (it tags an existing layer).

1. A session that ended (its client's DELETE, or closed idle) left the sandboxes it created
   running until their timeouts, and ``timeout_s`` is optional: nobody could reach them any
   more (another session is another client, SandboxScope), yet they counted against the
   client's share of sandboxes (mcp.SandboxShares) and the host's VMs for ever. A client
   that opened a session, created sandboxes and went away, again and again, left its share
   full for good, and with many addresses the daemon's VMs. Now the sandboxes a session
   created are killed when it ends (DELETE or idle; not when the server stops, and not
   with ``--all-sandboxes``, where any new session reaches them); the operator's
   ``--sandbox`` ones are never a session's. A create that ends after its session did
   kills what it started too.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from daemon_support import MCP_HELLO, FakeEngine, mcp_auth, running
from net_support import free_port, wait_until

from forkd.audit import AuditLog
from forkd.controller import app, mcp, server
from forkd.controller.backend import LocalBackend
from forkd.controller.sdk import Controller
from forkd.engine import children as ch
from forkd.engine.lifecycle import ChildInfo
from forkd.store.store import Store

TOKEN = b"t" * 43


class KillableEngine(FakeEngine):
    """FakeEngine whose sandboxes the daemon's kill ends (noting which)."""

    def __init__(self) -> None:
        super().__init__()
        self.killed: list[str] = []

    def kill(self, child_id: str, store: Store | None = None) -> ChildInfo:
        gone = next(c for c in self.children if c.id == child_id)
        self.end(child_id)
        self.killed.append(child_id)
        return gone

    def running(self) -> set[str]:
        return {c.id for c in self.children}


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> KillableEngine:
    fake = KillableEngine()
    monkeypatch.setattr(ch, "fork", fake.fork)
    monkeypatch.setattr(ch, "list_children", fake.list_children)
    monkeypatch.setattr(ch, "kill", fake.kill)
    return fake


@contextlib.contextmanager
def _mcp_on_daemon(place: Path, tmp_path: Path, **options: Any) -> Iterator[str]:
    """`forkd mcp --transport http` (``options`` of mcp.http_server) in front of the daemon
    on its socket: its URL."""
    sock = place / "ctl.sock"
    daemon_app = app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                                app.ControllerMetrics(), None)
    daemon = server.bounded_config(daemon_app, server.UnixPeerProtocol, uds=str(sock))
    port = free_port()
    with running(uvicorn.Server(daemon)):
        web = mcp.http_server(Controller(socket=sock, local=False), "127.0.0.1", port, "/mcp",
                              app.Token(TOKEN), **options)
        with running(web):
            yield f"http://127.0.0.1:{port}"


def answer(result: dict[str, Any]) -> Any:
    """A tool result's JSON (its text content)."""
    return json.loads(result["content"][0]["text"])


class McpClient:
    """One MCP client (its own source address) with a session, calling tools."""

    def __init__(self, url: str, source: str = "127.0.0.1") -> None:
        self.http = httpx.Client(base_url=url, timeout=30,
                                 transport=httpx.HTTPTransport(local_address=source))
        auth = mcp_auth(TOKEN)
        r = self.http.post("/mcp", json=MCP_HELLO, headers=auth)
        assert r.status_code == 200, r.text
        self.session = {**auth, "mcp-session-id": r.headers["mcp-session-id"],
                        "mcp-protocol-version": "2025-06-18"}
        self.http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                       headers=self.session)

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """The tool's result (its JSON-RPC ``result``) from the SSE answer."""
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": tool, "arguments": arguments}}
        text = self.http.post("/mcp", json=body, headers=self.session).text
        data = next(line[5:] for line in text.splitlines() if line.startswith("data:"))
        result: dict[str, Any] = json.loads(data)["result"]
        return result

    def made(self, tag: str, n: int) -> list[str]:
        result = self.call("create_sandboxes", tag=tag, n=n)
        assert not result["isError"], result
        ids: list[str] = answer(result)["sandboxes"]
        return ids

    def end(self) -> None:
        assert self.http.delete("/mcp", headers=self.session).status_code < 300
        self.http.close()


def test_a_session_that_ends_kills_the_sandboxes_it_created(
        place: Path, tmp_path: Path, engine: KillableEngine,
        request: pytest.FixtureRequest) -> None:
    """Before: a session ended by its client's DELETE left its sandboxes (no timeout_s)
    running for ever, unreachable (another session is another client) and counted against
    the client's share. Now they are killed when it ends; another session's, and the
    sandboxes the operator named, run on."""
    with _mcp_on_daemon(place, tmp_path, scope=mcp.SandboxScope(["sb-named"])) as url:
        gone, stays = McpClient(url), McpClient(url)
        request.addfinalizer(stays.http.close)
        mine = gone.made("tiny", 2)
        theirs = stays.made("tiny", 1)
        assert engine.running() == {*mine, *theirs}
        gone.end()
        wait_until("the ended session's sandboxes killed",
                   lambda: engine.running() == set(theirs), 10)
        assert sorted(engine.killed) == sorted(mine)
        killed = stays.call("kill_sandbox", sandbox_id=theirs[0])  # still theirs to use
        assert not killed["isError"], killed


def test_a_session_closed_idle_kills_the_sandboxes_it_created(
        place: Path, tmp_path: Path, engine: KillableEngine) -> None:
    """Before: a client that created sandboxes and went away without a DELETE left them
    running after its session was closed idle. Now the idle close kills them too."""
    with _mcp_on_daemon(place, tmp_path, session_idle_s=1.0) as url:
        client = McpClient(url)
        made = client.made("tiny", 3)
        client.http.close()  # gone without a word
        wait_until("the idle session's sandboxes killed", lambda: not engine.running(), 15)
        assert sorted(engine.killed) == sorted(made)


def test_with_all_sandboxes_a_session_that_ends_leaves_them_to_the_next(
        place: Path, tmp_path: Path, engine: KillableEngine) -> None:
    """``--all-sandboxes``: every session reaches every sandbox, so one that ends leaves its
    sandboxes for the next (as before)."""
    with _mcp_on_daemon(place, tmp_path, scope=mcp.SandboxScope(everything=True)) as url:
        client = McpClient(url)
        made = client.made("tiny", 2)
        client.end()
        after = McpClient(url)
        assert engine.running() == set(made)
        killed = after.call("kill_sandbox", sandbox_id=made[0])  # the next session's to use
        assert not killed["isError"], killed
        after.end()
    assert engine.killed == made[:1]


def test_a_create_that_ends_after_its_session_kills_what_it_started(
        place: Path, tmp_path: Path, engine: KillableEngine) -> None:
    """A create_sandboxes whose session ended while the sandboxes started (the daemon
    answered after the session's end was seen) would have noted them for a session that
    no longer is: they are killed, and the call says so."""
    from forkd.engine.agent_client import REQUEST_CLIENT
    from forkd.errors import ForkdError

    with _mcp_on_daemon(place, tmp_path):
        scope = mcp.SandboxScope()
        scope.session_open = lambda session: False  # ended while it ran
        tools = mcp.Tools(Controller(socket=place / "ctl.sock", local=False), scope=scope)
        client, session = REQUEST_CLIENT.set("127.0.0.1"), mcp.MCP_SESSION.set("s-gone")
        try:
            with pytest.raises(ForkdError, match="session ended while its 2 sandboxes"):
                tools.create_sandboxes("tiny", 2)
        finally:
            mcp.MCP_SESSION.reset(session)
            REQUEST_CLIENT.reset(client)
    assert engine.forks == 2 and not engine.running()
