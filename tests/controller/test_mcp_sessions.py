"""Over `forkd mcp --transport http`, a client is its MCP session, not only its address.

What an MCP client may reach (the sandboxes it created, the branch tags its ``force`` may
replace) was keyed by the client's address alone. Every local client of the server comes
from 127.0.0.1: two agents on one host (two Claude Code windows, two jobs of one runner)
were one client, and a prompt injection in one agent's context ran commands in, read from
and killed the other's sandboxes. Now a client is its address and its MCP session
(``mcp.calling_client``; ``mcp.MCP_SESSION`` is the session id each request of the
session carries, set by ``mcp.SessionMark``).
Tested with the official MCP client against the real HTTP server; the backend's spawn is
replaced (no VM): what is checked is which session reaches which sandbox id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from net_support import free_port

from forkd.controller import mcp
from forkd.controller.app import Token
from forkd.controller.sdk import Controller

TOKEN = b"mcp-sessions-token-0123456789-0123456789-0123456789"


class _Made:
    """A sandbox the replaced spawn hands back: an id and nothing to kill."""

    def __init__(self, sandbox_id: str) -> None:
        self.id = sandbox_id

    def kill(self) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    controller = Controller(local=True)
    made = iter(range(1, 1000))

    def spawn(tag: str, n: int, **_options: Any) -> list[_Made]:
        return [_Made(f"{tag}-{next(made)}") for _ in range(n)]

    monkeypatch.setattr(controller, "spawn_sandboxes", spawn)
    port = free_port()
    web = mcp.http_server(controller, "127.0.0.1", port, "/mcp", Token(TOKEN))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not web.started:
        assert time.monotonic() < deadline, "forkd mcp's HTTP server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        web.should_exit = True
        thread.join(30)


async def _said(session: ClientSession, tool: str, **args: Any) -> str:
    result = await session.call_tool(tool, args)
    return "".join(getattr(c, "text", "") for c in result.content)


def test_two_sessions_from_one_address_reach_only_their_own_sandboxes(server: str) -> None:
    async def main() -> None:
        headers = {"Authorization": f"Bearer {TOKEN.decode()}"}
        first_http = create_mcp_http_client(headers=headers)
        second_http = create_mcp_http_client(headers=headers)
        async with first_http, second_http, \
                streamable_http_client(server, http_client=first_http) as (r1, w1), \
                streamable_http_client(server, http_client=second_http) as (r2, w2), \
                ClientSession(r1, w1) as first, ClientSession(r2, w2) as second:
            await first.initialize()
            await second.initialize()
            made = await first.call_tool("create_sandboxes", {"tag": "tiny", "n": 2})
            assert made.structured_content is not None, made
            ids = made.structured_content["sandboxes"]
            assert len(ids) == 2
            # The second session, from the same address, reaches none of them.
            for tool, args in (("run_command", {"command": "true"}),
                               ("read_file", {"path": "/etc/hostname"}),
                               ("kill_sandbox", {})):
                said = await _said(second, tool, sandbox_id=ids[0], **args)
                assert "among the sandboxes this MCP client may use" in said, (tool, said)
            # The first session's own calls pass the scope: what answers is the backend
            # (no such child on this host: the replaced spawn started no VM).
            said = await _said(first, "run_command", sandbox_id=ids[0], command="true")
            assert "among the sandboxes" not in said and ids[0] in said, said
            # Each session's branch tags are its own too: the second may not replace one
            # the first made (none exists here, so both only reach the backend).
            theirs = await second.call_tool("create_sandboxes", {"tag": "other", "n": 1})
            assert theirs.structured_content is not None
            (other,) = theirs.structured_content["sandboxes"]
            said = await _said(first, "run_command", sandbox_id=other, command="true")
            assert "among the sandboxes this MCP client may use" in said, said

    anyio.run(main)


def test_a_client_is_its_address_and_its_session() -> None:
    scope = mcp.SandboxScope()
    marks = [mcp.REQUEST_CLIENT.set("127.0.0.1"), mcp.MCP_SESSION.set("one")]
    try:
        scope.made(["sb-1"])
        assert scope.allows("sb-1")
        other = mcp.MCP_SESSION.set("two")
        assert not scope.allows("sb-1")
        mcp.MCP_SESSION.reset(other)
        assert scope.allows("sb-1")
    finally:
        mcp.MCP_SESSION.reset(marks[1])
        mcp.REQUEST_CLIENT.reset(marks[0])
    assert not scope.allows("sb-1")  # no session, no address: another client (stdio)
