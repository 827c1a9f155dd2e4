"""The MCP server against the fourteenth hostile review: what one client's tools reach of
another's through the store. No VM: the engine's branch and spawn stand in (they tag an
existing layer, and record what would start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_support import Asked, as_client, branch_as_tag, listed_refs, store_with_base

from forkd.controller import backend as backend_mod
from forkd.controller import mcp
from forkd.controller.api import SpawnRequest, SpawnResult
from forkd.controller.sdk import Controller
from forkd.engine.branch import BranchResult
from forkd.errors import NotFound
from forkd.store.store import Store

ANY_SANDBOX = mcp.SandboxScope(everything=True)



@pytest.fixture
def based(place: Path, tmp_path: Path) -> Store:
    """The store of this test's FORKD_HOME, holding ``base:latest``."""
    return store_with_base(tmp_path, seed=14)


@pytest.fixture
def engine(based: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A branch tags ``base:latest`` anew (the sandbox's state, as far as the store sees);
    a spawn records the tag it was asked for, starts nothing and raises Asked."""
    spawned: list[str] = []

    def branch(store: Store, child_id: str, tag: str, force: bool = False) -> BranchResult:
        result: BranchResult = branch_as_tag(store, tag, force)
        return result

    def spawn(self: Any, req: SpawnRequest) -> SpawnResult:
        spawned.append(req.tag)
        raise Asked(req.tag)

    monkeypatch.setattr(backend_mod, "branch_child", branch)
    monkeypatch.setattr(backend_mod.LocalBackend, "spawn", spawn)
    return spawned


def test_a_branch_one_mcp_client_made_is_not_anothers_to_fork_or_list(
        engine: list[str]) -> None:
    """A client's sandboxes are out of other clients' reach (SandboxScope), but a branch of
    one was not: list_snapshots showed it to every client of the server, and
    fork_from_branch (or create_sandboxes) of it gave a prompt-injected model a sandbox in
    the other client's state, its files, its interpreter's variables and whatever keys it
    had been handed, to read at will. Now a branch made here by another client (another
    address, or another MCP session of the same one) is left out of list_snapshots and is
    NotFound to fork, before anything starts; its maker and snapshots made elsewhere are
    served as before."""
    # every client may use sb-1 (the operator named it): its branch is its maker's
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]))
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "secret-work:1")
        assert "secret-work:1" in listed_refs(tools)
    for other in (("127.0.0.1", "session-b"), ("10.0.0.2", "session-a")):
        with as_client(*other):
            assert listed_refs(tools) == ["base:latest"]
            with pytest.raises(NotFound, match="among those this MCP client may fork"):
                tools.fork_from_branch("secret-work:1")
            with pytest.raises(NotFound, match="among those this MCP client may fork"):
                tools.create_sandboxes("secret-work:1", 2)
            with pytest.raises(Asked):
                tools.create_sandboxes("base")  # what was built or pulled stays everyone's
    assert engine == ["base", "base"]
    with as_client("127.0.0.1", "session-a"):
        with pytest.raises(Asked):
            tools.fork_from_branch("secret-work:1")  # its maker forks it
        tools.branch_sandbox("sb-1", "secret-work")  # :latest, by any spelling
    with as_client("127.0.0.1", "session-b"):
        assert listed_refs(tools) == ["base:latest"]
        with pytest.raises(NotFound):
            tools.create_sandboxes("secret-work:latest")
    assert engine == ["base", "base", "secret-work:1"]


def test_every_client_forks_every_branch_with_all_sandboxes(engine: list[str]) -> None:
    """``forkd mcp --all-sandboxes`` gives every client every sandbox; the branches too."""
    tools = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX)
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "shared:1")
    with as_client("127.0.0.1", "session-b"):
        assert "shared:1" in listed_refs(tools)
        with pytest.raises(Asked):
            tools.fork_from_branch("shared:1")
    assert engine == ["shared:1"]


def test_another_clients_paused_sandbox_is_notlisted_refs(based: Store) -> None:
    """A paused sandbox's saved state is a tag (``forkd-paused/ID:a``) that names the
    sandbox: list_snapshots showed every paused sandbox's id to every client. Now a client
    sees only those of sandboxes it may reach; no spawn takes either."""
    based.tag("forkd-paused/sb-1:a", "base:latest")
    based.tag("forkd-paused/sb-2:a", "base:latest")
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]))
    with as_client("127.0.0.1", "session-a"):
        assert listed_refs(tools) == ["base:latest", "forkd-paused/sb-1:a"]
    everyone = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX)
    with as_client("127.0.0.1", "session-a"):
        assert "forkd-paused/sb-2:a" in listed_refs(everyone)
