"""The MCP server, and the engine beneath it, against the sixteenth hostile review. No VM
(tests/controller/test_review_hostile_ctl16_vm.py has 4 with real VMs): the engine's branch
and spawn stand in where a branch is made (they tag an existing layer), the real apps and
protocols on uvicorn where a session ends, a stand-in agent where the relay serves.

1. A fork of another client's hidden branch was NotFound in the MCP server's words ("no
   snapshot T among those this MCP client may fork"), a fork of a tag nobody made was the
   engine's ("no tag T in …"), and with ``lazy`` the daemon called the hidden one "a local
   snapshot tag": a client told which names other clients had branched to, and so what
   they worked on. Now both are the same answer, word for word.
2. A session's branches (branch_sandbox tags) outlived it: hidden from every other client
   while the server ran, nobody's once the session ended (another session is another
   client), they filled the store out of everyone's reach, and once the server restarted
   (its memory of makers gone) every client listed and forked them, the maker's sandbox
   state, files and keys. Now a session's branches are removed when it ends (DELETE, idle,
   the server stopping; not with ``--all-sandboxes``), the ones still naming its branch;
   one made while its session ended is removed at once. A server that ended without
   removing them (killed, crashed) left them for the next to publish: now each HTTP
   server keeps the branches it has not removed in a record under $FORKD_RUN (locked
   while it runs), and a starting server removes those of every server that is gone.
3. Nothing bounded the branches one client made: branch_sandbox to one new tag after
   another put a layer of a sandbox's memory and disk in the store each time, until the
   host's disk was full. Now one client (an address) holds at most
   mcp.MAX_BRANCHES_PER_CLIENT made on the server that still name its branch, counting
   the ones it is making; replacing its own (``force``) is not a new one.
4. A sandbox id had 24 random bits (lifecycle.new_id): it came round among a long-running
   host's ids, and whatever still held the old one (an MCP client's scope until it next
   listed, a script, an operator acting on a log) reached another client's new sandbox by
   it. Longer ids had been tried and taken back: a child's sockets are under
   ``$FORKD_RUN/children/ID/``, and a long run directory put them past AF_UNIX's 108
   bytes. Now the host binds and connects to a socket whose path is too long through
   /proc/self/fd of its directory (paths.unix_address: the relay's, QEMU's agent and QMP
   sockets), QEMU binds its own by a name relative to its working directory, the child's
   (qemu.socket_arg), and an id has 64 random bits.
5. An event's header line past 4096 bytes: the relay read no payload size from it (and so
   passed the payload's bytes on as lines, a guest program's output parsed as frames),
   while a client read the size and took that many bytes (through the relay, the next
   frames). Now a client refuses such a header as a broken protocol, as the relay
   ignores it (agent_client.EVENT_HEAD_MAX, one bound for both).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from daemon_support import (
    Asked,
    McpClient,
    as_client,
    branch_as_tag,
    listed_refs,
    store_with_base,
)
from net_support import free_port, running, wait_until

from forkd.controller import app, mcp
from forkd.controller import backend as backend_mod
from forkd.controller.api import SpawnRequest, SpawnResult
from forkd.controller.sdk import Controller
from forkd.engine.agent_client import RELAY_SOCKET, connect_child, relay_main
from forkd.engine.branch import BranchResult
from forkd.engine.errors import TooManyRequests
from forkd.engine.lifecycle import ID_RE, new_id, private_owner
from forkd.engine.paths import fits_sun_path, unix_address
from forkd.errors import Conflict, ForkdError, NotFound
from forkd.store.store import Store
from forkd.synthetic import write_base


@pytest.fixture
def store(place: Path, tmp_path: Path) -> Store:
    """The store of this test's FORKD_HOME, holding ``base:latest``."""
    return store_with_base(tmp_path, seed=16)


@pytest.fixture
def engine(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A branch tags ``base:latest`` anew; a spawn of a tag the store lacks is the engine's
    NotFound, of any other it records the tag and raises Asked."""
    spawned: list[str] = []

    def branch(store: Store, child_id: str, tag: str, force: bool = False) -> BranchResult:
        result: BranchResult = branch_as_tag(store, tag, force)
        return result

    real_spawn = backend_mod.LocalBackend.spawn

    def spawn(self: Any, req: SpawnRequest) -> SpawnResult:
        if req.lazy:  # the daemon's checks of a lazy fork's tag, which refuse what follows
            return real_spawn(self, req)
        if private_owner(req.tag) is None:  # the engine refuses those before it looks
            self.store.resolve(req.tag)
        spawned.append(req.tag)
        raise Asked(req.tag)

    monkeypatch.setattr(backend_mod, "branch_child", branch)
    monkeypatch.setattr(backend_mod.LocalBackend, "spawn", spawn)
    return spawned


def _refusal(call: Any, tag: str) -> str:
    """The NotFound ``call(tag)`` raises, the tag's name taken out of its text."""
    with pytest.raises(NotFound) as refused:
        call(tag)
    return str(refused.value).replace(tag, "TAG")


def test_another_clients_branch_is_refused_as_a_tag_nobody_made(
        store: Store, engine: list[str]) -> None:
    """Before: client B's fork_from_branch of A's hidden branch ``secret-work:1`` was "no
    snapshot secret-work:1 among those this MCP client may fork", of ``never-made:1`` the
    engine's "no tag never-made:1 in …": B learnt every name A branched to. Now both are
    the same NotFound, word for word, through every tool that forks, and the same
    InvalidInput for a lazy fork (no hub reference); nothing starts."""
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]))
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "secret-work:1")
    with as_client("127.0.0.1", "session-b"):
        for call in (tools.fork_from_branch, tools.create_sandboxes):
            hidden = _refusal(call, "secret-work:1")
            assert hidden == _refusal(call, "never-made:1")
            assert hidden == _refusal(call, "never-made")  # NAME alone: NAME:latest
        for lazy in (True, False):
            create = functools.partial(tools.create_sandboxes, lazy=lazy)
            with pytest.raises(ForkdError) as hidden_lazy:
                create("secret-work:1")
            with pytest.raises(ForkdError) as missing_lazy:
                create("never-made:1")
            assert type(hidden_lazy.value) is type(missing_lazy.value)
            assert (str(hidden_lazy.value).replace("secret-work:1", "TAG")
                    == str(missing_lazy.value).replace("never-made:1", "TAG"))
        assert engine == []
        # a paused sandbox's saved state is the engine's to refuse, there or not
        store.tag("forkd-paused/sb-1:a", "base:latest")
        for tag in ("forkd-paused/sb-1:a", "forkd-paused/sb-9:a"):
            with pytest.raises(Asked):
                tools.create_sandboxes(tag)
    with as_client("127.0.0.1", "session-a"), pytest.raises(Asked):
        tools.fork_from_branch("secret-work:1")  # its maker's, as before


# -- a session's branches (2) and a client's (3)
TOKEN = b"t" * 43


def _tags(store: Store) -> set[str]:
    return set(store.tags.read())


def _branch(client: McpClient, tag: str, **arguments: Any) -> None:
    said = client.tool_text("branch_sandbox", sandbox_id="sb-1", tag=tag, **arguments)
    assert '"isError":false' in said.replace(" ", ""), said


def _mcp(scope: mcp.SandboxScope) -> tuple[Any, str]:
    """`forkd mcp --transport http` in process (the engine's branch standing in), not
    started, and its URL."""
    port = free_port()
    web = mcp.http_server(Controller(local=True), "127.0.0.1", port, "/mcp",
                          app.Token(TOKEN), session_idle_s=30.0, scope=scope)
    return web, f"http://127.0.0.1:{port}"


def test_a_session_that_ends_removes_its_branches(
        store: Store, engine: list[str], request: pytest.FixtureRequest,
        tmp_path: Path) -> None:
    """Before: A's branches stayed in the store after its session ended, forkable by no MCP
    client (hidden from B, and A's next session is another client) until the server
    restarted and forgot their maker: then every client's. Now A's DELETE removes them;
    B's stay, and so does one the operator put under A's name meanwhile."""
    web, url = _mcp(mcp.SandboxScope(["sb-1"]))
    with running(web):
        a, b = McpClient(url, TOKEN), McpClient(url, TOKEN)
        request.addfinalizer(b.http.close)
        _branch(a, "a-old:1")
        _branch(a, "a-work:1")
        _branch(b, "b-work:1")
        store.remove("a-old:1")
        image = tmp_path / "operators.img"
        write_base(image, 1 << 20, seed=161, random_share=1.0)
        store.import_layer("a-old:1", memory=image)  # the operator's, under A's old name
        operators = store.resolve("a-old:1")
        assert a.http.delete("/mcp", headers=a.session).status_code < 300
        a.http.close()
        # removed in the order made: once a-work:1 is gone, a-old:1 was decided
        wait_until("A's branch removed", lambda: "a-work:1" not in _tags(store), 15)
        assert store.resolve("a-old:1") == operators
        assert {"b-work:1", "base:latest"} <= _tags(store)
        with as_client("127.0.0.1", "another"):
            tools = mcp.Tools(Controller(local=True))
            assert "a-work:1" not in listed_refs(tools)


def test_the_server_stopping_removes_every_sessions_branches(
        store: Store, engine: list[str]) -> None:
    """Before: the server stopped with A's branch in the store, and the next server, knowing
    no maker, listed it to every client and forked it for any. Now the branches of every
    session are removed before the server ends; with ``--all-sandboxes`` (any session
    forks any branch) they stay."""
    for everything in (False, True):
        web, url = _mcp(mcp.SandboxScope(["sb-1"], everything=everything))
        tag = f"kept-{everything}:1".lower()
        with running(web):
            client = McpClient(url, TOKEN)
            _branch(client, tag)
            client.http.close()
        if everything:
            assert tag in _tags(store)
        else:
            wait_until("the branch removed", lambda t=tag: t not in _tags(store), 15)


def test_a_branch_made_as_its_session_ended_is_removed(
        store: Store, engine: list[str]) -> None:
    """A branch_sandbox whose session ended while the engine branched would have noted a
    branch for a session that no longer is, never removed: it is removed, and the call
    says so."""
    branches = mcp.BranchTags(Controller(local=True))
    branches.session_open = lambda session: False
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]),
                      branches=branches)
    with (as_client("127.0.0.1", "gone"),
          pytest.raises(ForkdError, match="session ended while it branched")):
        tools.branch_sandbox("sb-1", "late:1")
    assert "late:1" not in _tags(store)
    # --all-sandboxes: any session forks it, it stays
    branches = mcp.BranchTags(Controller(local=True), everything=True)
    branches.session_open = lambda session: False
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(everything=True),
                      branches=branches)
    with as_client("127.0.0.1", "gone"):
        tools.branch_sandbox("sb-1", "late:1")
    assert "late:1" in _tags(store)


def test_one_client_holds_a_bounded_number_of_branches(
        store: Store, engine: list[str]) -> None:
    """Before: one client's branch_sandbox to new tags, one after another, each put a layer
    of the sandbox's memory and disk in the store, without end. Now a client (an address,
    all its sessions) holds at most ``per_client``: past it TooManyRequests, nothing made;
    its own tag replaced with force is no new one; another address has its own; a branch
    the operator removed gives its place back."""
    branches = mcp.BranchTags(Controller(local=True), per_client=2)
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]),
                      branches=branches)
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "one:1")
    with as_client("127.0.0.1", "session-b"):
        tools.branch_sandbox("sb-1", "two:1")
        with pytest.raises(TooManyRequests, match=r"holds 2 branches .* \(2;"):
            tools.branch_sandbox("sb-1", "three:1")
        tools.branch_sandbox("sb-1", "two:1", force=True)  # its own, replaced
        with pytest.raises(Conflict):
            tools.branch_sandbox("sb-1", "one:1", force=True)  # A's session's, not B's
    assert "three:1" not in _tags(store)
    with as_client("10.0.0.2", "session-c"):
        tools.branch_sandbox("sb-1", "other:1")
    store.remove("one:1")
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "three:1")


# -- ids and the sockets' paths (4)
def _pong(req: dict[str, Any]) -> bytes:
    return json.dumps({"id": req["id"], "ok": True, "result": {"pong": True}}).encode() + b"\n"


class PingAgent:
    """QEMU's agent chardev at ``path`` (bound as QEMU binds it, socket_arg from its working
    directory: here through unix_address), answering every request with ``answer`` (a
    pong)."""

    def __init__(self, path: Path, answer: Any = _pong) -> None:
        self.answer = answer
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(path) as address:
            self.listener.bind(address)
        self.listener.listen(4)
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            self.conns.append(conn)
            for line in conn.makefile("rb"):
                req = json.loads(line)
                if req.get("op") != "cancel":
                    conn.sendall(self.answer(req))

    def close(self) -> None:
        for c in self.conns:
            c.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(10)


def _long_child_dir(tmp_path: Path) -> Path:
    """A child's directory under a run directory long enough that its sockets' paths are
    past 108 bytes (as the VM test's tmp_path put them, with an id of 24 random bits)."""
    d = tmp_path / ("r" * 60) / "children" / new_id("python:3.13")
    d.mkdir(parents=True)
    assert not fits_sun_path(d / "agent.sock")
    return d


def test_a_sandbox_id_has_64_random_bits() -> None:
    """Before: ``<name>-<6 hex>``, 24 bits. Now 16 hex, still an id (ID_RE)."""
    for ref in ("python:3.13", "a-very-long-snapshot-name-of-forty-characters:1", "---", "x"):
        made = {new_id(ref) for _ in range(200)}
        assert len(made) == 200
        for sandbox_id in made:
            assert ID_RE.fullmatch(sandbox_id), sandbox_id
            assert len(sandbox_id.rsplit("-", 1)[1]) * 4 == 64, sandbox_id


def test_a_childs_relay_serves_under_a_run_directory_past_sun_path(tmp_path: Path) -> None:
    """Before: under a long run directory the child's relay could not connect to QEMU's
    agent socket nor bind its own ('cannot start: AF_UNIX path too long'), and no client
    reached the guest. Now it serves there as anywhere: its socket is bound, renamed into
    place and connected to through the directory's /proc/self/fd."""
    d = _long_child_dir(tmp_path)
    agent = PingAgent(d / "agent.sock")
    ended: list[int] = []
    relay = threading.Thread(target=lambda: ended.append(relay_main(d)), daemon=True)
    relay.start()
    try:
        wait_until("the relay listening", lambda: (d / RELAY_SOCKET).exists() or bool(ended),
                   15)
        assert not ended, "the relay did not start"
        client = connect_child(d)
        try:
            assert client.request("ping", timeout=20) == {"pong": True}
        finally:
            client.close()
    finally:
        agent.close()  # as QEMU exiting: the relay ends
        relay.join(15)
    assert ended == [0]


def test_qemu_binds_its_sockets_relative_to_the_childs_directory_when_too_long(
        tmp_path: Path) -> None:
    """Before: QEMU was told ``d/qmp.sock`` and ``d/agent.sock`` whole, and could not bind
    them past 108 bytes. Now a path that does not fit is named relative to QEMU's working
    directory (the child's, QemuVM.launch), the one that fits as before; a QEMU so started
    is still recognised as the child's (pid_matches, by its working directory), and a
    process elsewhere is not."""
    from forkd.engine.qemu import VMConfig, build_argv, pid_matches

    cfg = VMConfig(memory_mib=256, vcpus=1, accel="tcg", mem_path=Path("/x/mem"),
                   share=False, disk=Path("/x/d.qcow2"), incoming=True)
    d = _long_child_dir(tmp_path)
    argv = " ".join(build_argv(cfg, d))
    assert "unix:qmp.sock,server=on" in argv and "path=agent.sock,server=on" in argv
    short = Path("/run/c1")
    argv = " ".join(build_argv(cfg, short))
    assert f"unix:{short}/qmp.sock," in argv and f"path={short}/agent.sock," in argv
    here = subprocess.Popen(["sleep", "60"], cwd=d)
    elsewhere = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    linked = tmp_path / ("l" * 80)  # $FORKD_RUN reached through a symlink
    linked.symlink_to(d.parent)
    try:
        assert pid_matches(here.pid, d)
        assert pid_matches(here.pid, linked / d.name)
        assert not pid_matches(elsewhere.pid, d)
    finally:
        for p in (here, elsewhere):
            p.kill()
            p.wait()


def test_an_event_header_past_the_relays_bound_is_a_broken_protocol(tmp_path: Path) -> None:
    """Before: an event whose header line was 5,000 bytes (a padded field) was taken, its
    payload read by its size, by a client connected to the agent, while the relay passes
    that payload on as lines. Now it is the protocol's error, as a header of the agent's
    size still streams."""
    from forkd.engine.agent_client import EVENT_HEAD_MAX, AgentClient
    from forkd.engine.errors import AgentError

    def padded(pad: int) -> Any:
        def answer(req: dict[str, Any]) -> bytes:
            head = {"id": req["id"], "ev": "stdout", "size": 6, "pad": "x" * pad}
            return json.dumps(head).encode() + b"\nhello\n" + _pong(req)
        return answer

    for pad, refused in ((10, False), (EVENT_HEAD_MAX, True)):
        d = tmp_path / str(pad)
        d.mkdir()
        agent = PingAgent(d / "agent.sock", padded(pad))
        client = AgentClient(d / "agent.sock")
        heard: list[bytes] = []
        on_event = functools.partial(lambda into, ev, data: into.append(data), heard)
        try:
            if refused:
                with pytest.raises(AgentError, match=r"event header of .* over the 4096"):
                    client.request("ping", timeout=20, on_event=on_event)
            else:
                assert client.request("ping", timeout=20, on_event=on_event) == {"pong": True}
        finally:
            client.close()
            agent.close()
        assert heard == ([] if refused else [b"hello\n"])


def _records() -> dict[str, Any]:
    """The branch records under this test's $FORKD_RUN: file name, what it holds."""
    from forkd.engine.paths import run_path

    return {p.name: json.loads(p.read_text())
            for p in sorted((run_path() / "mcp-branches").glob("*.json"))}


def test_a_server_records_its_branches_until_they_are_removed(
        store: Store, engine: list[str]) -> None:
    """Each HTTP server keeps the branches it made and has not removed in its record, so
    that one left behind by a crash is removed by the next server."""
    web, url = _mcp(mcp.SandboxScope(["sb-1"]))
    with running(web):
        client = McpClient(url, TOKEN)
        _branch(client, "recorded:1")
        assert list(_records().values()) == [{"recorded:1": store.resolve("recorded:1")}]
        assert client.http.delete("/mcp", headers=client.session).status_code < 300
        client.http.close()
        wait_until("the record emptied", lambda: list(_records().values()) == [{}], 15)
    assert "recorded:1" not in _tags(store)


def test_a_starting_server_removes_the_branches_a_gone_server_left(
        store: Store, engine: list[str], tmp_path: Path) -> None:
    """Before: a server killed with branches of its sessions in the store left them to the
    next, which knew no maker: every client listed and forked them. Now a starting server
    removes the branches a gone server's record names, those still naming what it
    branched (a tag the operator used again stays), and leaves a running server's."""
    from forkd.engine.paths import run_dir

    records = run_dir() / "mcp-branches"
    records.mkdir()
    for tag in ("gone:1", "moved:1", "live:1"):
        store.tag(tag, "base:latest")
    left = {"gone:1": store.resolve("gone:1"), "moved:1": store.resolve("moved:1")}
    (records / "4242-dead.json").write_text(json.dumps(left))
    (records / "4242-dead.lock").write_text("")  # nobody holds it: its server is gone
    store.remove("moved:1")
    image = tmp_path / "operators.img"
    write_base(image, 1 << 20, seed=162, random_share=1.0)
    store.import_layer("moved:1", memory=image)  # the operator's, under the old name
    live = mcp.BranchRecord(records)  # a server that runs
    live.write({"live:1": store.resolve("live:1")})
    _mcp(mcp.SandboxScope(["sb-1"]))  # a server starts
    assert "gone:1" not in _tags(store)
    assert {"moved:1", "live:1"} <= _tags(store)
    assert "4242-dead.json" not in _records()
    assert not (records / "4242-dead.lock").exists()
    assert _records()[live.path.name] == {"live:1": store.resolve("live:1")}
