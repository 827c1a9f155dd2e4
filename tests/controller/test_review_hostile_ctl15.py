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
2. A branch_sandbox tag stayed its maker's by name for ever: removed (``forkd rmi``, REST)
   and then used again by the operator (a pull, a build, a branch through the CLI), it
   was still hidden from every other MCP client (list_snapshots left it out, a fork was
   NotFound) and its first maker's ``force`` replaced what the operator had put there,
   the very replacement round 14 forbade. Now a tag is a client's branch while it names
   the digest that client's branch made (mcp.BranchTags.maker).
3. ``force`` was checked, then the branch made: a tag that did not exist when checked
   but that another client branched meanwhile was replaced by the force that was let
   through for "nothing to replace". Now a branch of one tag is made one at a time on
   the server, and ``force`` reaches the engine only for a tag the caller made; else a
   tag made meanwhile is the engine's Conflict.
4. An MCP client's scope kept every sandbox id it had created for ever (killed, ended by
   its timeout), and an id has 24 random bits (lifecycle.new_id): a new sandbox of
   another client that got an old id again (one in 16 M per fork, per id remembered) was
   the old client's to read, run in and kill. Now the scope forgets an id once its
   sandbox is killed (kill_sandbox) or is missing from a listing (list_sandboxes, which
   also asks the daemon once, not once per sandbox: one that ended meanwhile failed the
   whole call).
5. One client's share of MCP sessions (mcp.SessionShare, half of them) was checked against
   the sessions it had opened, and a session counted once its answer started: requests
   that opened sessions at once each found the share unfilled, so one client sending its
   initializes together held every session of the server (256, kept 10 minutes while
   idle, again and again), and every other client got 503. Its sessions were also lost
   from the count: each request replaced the client's set with a copy, so a session
   another request noted in the old set meanwhile was never counted. Now a session being
   opened counts from its request's start until it is noted (once), in one set per client.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import daemon_support
import httpx
import pytest
import uvicorn
from daemon_support import (
    MCP_HELLO,
    FakeEngine,
    as_client,
    branch_as_tag,
    listed_refs,
    mcp_auth,
    running,
)
from net_support import PATIENCE_S, free_port, wait_until

from forkd.audit import AuditLog
from forkd.controller import app, mcp, server
from forkd.controller import backend as backend_mod
from forkd.controller.api import SpawnRequest, SpawnResult
from forkd.controller.backend import LocalBackend
from forkd.controller.sdk import Controller
from forkd.engine import children as ch
from forkd.engine.agent_client import REQUEST_CLIENT
from forkd.engine.branch import BranchResult
from forkd.engine.lifecycle import ChildInfo
from forkd.errors import Conflict, ForkdError, NotFound
from forkd.store.store import Store
from forkd.synthetic import write_base

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


class McpClient(daemon_support.McpClient):
    """One MCP client (its own source address) with a session, calling tools."""

    def __init__(self, url: str, source: str = "127.0.0.1") -> None:
        super().__init__(url, TOKEN, source)

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """The tool's result (its JSON-RPC ``result``) from the SSE answer."""
        text = self.tool_text(tool, **arguments)
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
                   lambda: engine.running() == set(theirs), PATIENCE_S)
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
        wait_until("the idle session's sandboxes killed", lambda: not engine.running(), PATIENCE_S)
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


# -- branches (2, 3): the engine's branch tags an existing layer, its spawn records the tag
class Asked(ForkdError):
    """The stand-in spawn was asked to fork (the tag got past the tool's checks)."""


def _layer(store: Store, ref: str, seed: int, tmp_path: Path) -> None:
    image = tmp_path / f"{seed}.img"
    write_base(image, 1 << 20, seed=seed, random_share=1.0)
    store.import_layer(ref, memory=image)


@pytest.fixture
def store(place: Path, tmp_path: Path) -> Store:
    """The store of this test's FORKD_HOME, holding ``base:latest``."""
    opened = Store.open()
    _layer(opened, "base:latest", 15, tmp_path)
    return opened


@pytest.fixture
def branched(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A branch tags ``base:latest`` anew (after running what the list holds, which stands
    for what another client did meanwhile); a spawn raises Asked."""
    meanwhile: list[Any] = []

    def branch(store: Store, child_id: str, tag: str, force: bool = False) -> BranchResult:
        while meanwhile:
            meanwhile.pop(0)()
        result: BranchResult = branch_as_tag(store, tag, force)
        return result

    def spawn(self: Any, req: SpawnRequest) -> SpawnResult:
        raise Asked(req.tag)

    monkeypatch.setattr(backend_mod, "branch_child", branch)
    monkeypatch.setattr(backend_mod.LocalBackend, "spawn", spawn)
    return meanwhile


def test_a_branch_tag_removed_and_used_again_is_no_longer_its_makers(
        store: Store, branched: list[Any], tmp_path: Path) -> None:
    """Before: client A's branch ``work:1``, removed by the operator and pulled again (another
    layer under that name), stayed A's: hidden from B, NotFound to fork, and A's force
    replaced the operator's snapshot. Now it is everyone's, and A's force is a Conflict."""
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]))
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "work:1")
    with as_client("127.0.0.1", "session-b"):
        assert "work:1" not in listed_refs(tools)  # A's branch, as round 14 has it
    store.remove("work:1")
    _layer(store, "work:1", 16, tmp_path)  # the operator's, built or pulled
    with as_client("127.0.0.1", "session-b"):
        assert "work:1" in listed_refs(tools)
        with pytest.raises(Asked):
            tools.create_sandboxes("work:1")
    operators = store.resolve("work:1")
    with (as_client("127.0.0.1", "session-a"),
          pytest.raises(Conflict, match="not a branch this client made")):
        tools.branch_sandbox("sb-1", "work:1", force=True)
    assert store.resolve("work:1") == operators


def test_a_tag_branched_by_another_client_meanwhile_is_not_replaced_by_force(
        store: Store, branched: list[Any], tmp_path: Path) -> None:
    """Before: A's branch_sandbox(force=True) to a tag that did not exist when checked
    replaced the branch B made of it meanwhile (the force was let through for "nothing to
    replace"). Now it is a Conflict from the engine, and B's branch stays B's."""
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1", "sb-2"]))

    def b_branches() -> None:
        _layer(store, "race:1", 17, tmp_path)  # B's branch, between A's check and act

    branched.append(b_branches)
    with as_client("127.0.0.1", "session-a"), pytest.raises(Conflict):
        tools.branch_sandbox("sb-1", "race:1", force=True)
    assert store.resolve("race:1") != store.resolve("base:latest")  # B's, still
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "mine:1")
        tools.branch_sandbox("sb-1", "mine:1", force=True)  # its own: replaced as before


def test_one_branch_of_a_tag_at_a_time(store: Store, branched: list[Any]) -> None:
    """Two branches of one tag on the server do not interleave their check and act."""
    import threading

    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1", "sb-2"]))
    inside = threading.Event()
    release = threading.Event()
    results: list[str] = []

    def slow() -> None:
        inside.set()
        release.wait(10)

    def branch_as(session: str) -> None:
        with as_client("127.0.0.1", session):
            try:
                tools.branch_sandbox("sb-1", "both:1", force=True)
                results.append(session)
            except Conflict:
                results.append("conflict")

    branched.append(slow)
    first = threading.Thread(target=branch_as, args=("session-a",))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=branch_as, args=("session-b",))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waits for the first branch of the tag to be recorded
    release.set()
    first.join(10)
    second.join(10)
    assert results == ["session-a", "conflict"]
    with as_client("127.0.0.1", "session-b"), pytest.raises(NotFound):
        tools.fork_from_branch("both:1")


# -- ids that come round again (4)
class ReusingEngine(KillableEngine):
    """KillableEngine whose forks take the ids of ``ids`` in turn (an id come round)."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__()
        self.ids = ids

    def fork(self, store: Store, ref: str, n: int, **options: Any) -> ch.ForkResult:
        result = super().fork(store, ref, n, **options)
        for child in result.children:
            child.id = self.ids.pop(0)
        return result


@pytest.mark.parametrize("ended", ["killed by its client", "ended otherwise, then listed"])
def test_an_id_that_comes_round_again_is_not_its_old_clients(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ended: str) -> None:
    """Before: client A's sandbox ``sb-x`` ended; B's next sandbox got the id ``sb-x`` again,
    and A's kill_sandbox of it killed B's sandbox (its scope had kept the id). Now A's scope
    forgot it when it ended: ChildNotFound, and B's runs on."""
    from forkd.engine.errors import ChildNotFound

    engine = ReusingEngine(["sb-x", "sb-x"])
    monkeypatch.setattr(ch, "fork", engine.fork)
    monkeypatch.setattr(ch, "list_children", engine.list_children)
    monkeypatch.setattr(ch, "kill", engine.kill)
    with _mcp_on_daemon(place, tmp_path):
        tools = mcp.Tools(Controller(socket=place / "ctl.sock", local=False))
        with as_client("127.0.0.1", "session-a"):
            assert tools.create_sandboxes("tiny")["sandboxes"] == ["sb-x"]
            if ended == "killed by its client":
                tools.kill_sandbox("sb-x")
            else:
                engine.end("sb-x")  # its timeout, a kill through REST
                assert tools.list_sandboxes()["sandboxes"] == []
        with as_client("127.0.0.1", "session-b"):
            assert tools.create_sandboxes("tiny")["sandboxes"] == ["sb-x"]
        with as_client("127.0.0.1", "session-a"):
            with pytest.raises(ChildNotFound, match="may use"):
                tools.kill_sandbox("sb-x")
            assert tools.list_sandboxes()["sandboxes"] == []
        with as_client("127.0.0.1", "session-b"):
            assert [s["id"] for s in tools.list_sandboxes()["sandboxes"]] == ["sb-x"]
    assert engine.running() == {"sb-x"}


# -- sessions opened at once (5)
def test_sessions_opened_at_once_stay_within_the_clients_share(place: Path) -> None:
    """Before: 12 initializes sent together from one address all passed its share of 3
    (each found the share unfilled: a session counted once its answer had started), and
    took every session of the server. Now 3 are opened, the rest are 503 naming the share,
    and another client still opens one."""
    import threading

    from net_support import free_port as port_of

    port = port_of()
    web = mcp.http_server(Controller(local=True), "127.0.0.1", port, "/mcp",
                          app.Token(TOKEN), max_sessions=8, session_idle_s=30.0,
                          max_sessions_per_client=3)
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    said: list[str] = []
    go = threading.Barrier(12)

    def initialize() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            go.wait(10)
            r = http.post("/mcp", json=MCP_HELLO, headers=mcp_auth(TOKEN))
            statuses.append(r.status_code)
            if r.status_code == 503:
                said.append(r.text)

    with running(web):
        threads = [threading.Thread(target=initialize) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(statuses) == [200] * 3 + [503] * 9, (statuses, said)
        assert all("this client (127.0.0.1)" in text and "3 of 8" in text for text in said)
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=url, timeout=10, transport=other) as elsewhere:
            r = elsewhere.post("/mcp", json=MCP_HELLO, headers=mcp_auth(TOKEN))
            assert r.status_code == 200, r.text
