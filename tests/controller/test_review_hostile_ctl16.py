"""The MCP server and the engine's sandbox ids against the sixteenth hostile review. No VM:
the engine's branch and spawn stand in where a branch is made (they tag an existing layer),
and the real apps and protocols on uvicorn where a session ends.

1. A fork of another client's hidden branch was NotFound in the MCP server's words ("no
   snapshot T among those this MCP client may fork"), a fork of a tag nobody made was the
   engine's ("no tag T in …"): a client told which names other clients had branched to,
   and so what they worked on. Now both are the same answer, word for word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_support import as_client, branch_as_tag

from forkd.controller import backend as backend_mod
from forkd.controller import mcp
from forkd.controller.api import SpawnRequest, SpawnResult
from forkd.controller.sdk import Controller
from forkd.engine.branch import BranchResult
from forkd.errors import ForkdError, NotFound
from forkd.store.store import Store
from forkd.synthetic import write_base


class Asked(ForkdError):
    """The stand-in spawn was asked to fork (the tag got past the tool's checks)."""


@pytest.fixture
def store(place: Path, tmp_path: Path) -> Store:
    """The store of this test's FORKD_HOME, holding ``base:latest``."""
    opened = Store.open()
    image = tmp_path / "base.img"
    write_base(image, 1 << 20, seed=16, random_share=1.0)
    opened.import_layer("base:latest", memory=image)
    return opened


@pytest.fixture
def engine(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A branch tags ``base:latest`` anew; a spawn records the tag and raises Asked."""
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
    the same NotFound, word for word, through every tool that forks; nothing starts."""
    tools = mcp.Tools(Controller(local=True), scope=mcp.SandboxScope(["sb-1"]))
    with as_client("127.0.0.1", "session-a"):
        tools.branch_sandbox("sb-1", "secret-work:1")
    with as_client("127.0.0.1", "session-b"):
        for call in (tools.fork_from_branch, tools.create_sandboxes):
            hidden = _refusal(call, "secret-work:1")
            assert hidden == _refusal(call, "never-made:1")
            assert hidden == _refusal(call, "never-made")  # NAME alone: NAME:latest
        assert engine == []
        # a paused sandbox's saved state is the engine's to refuse, there or not
        store.tag("forkd-paused/sb-1:a", "base:latest")
        for tag in ("forkd-paused/sb-1:a", "forkd-paused/sb-9:a"):
            with pytest.raises(Asked):
                tools.create_sandboxes(tag)
    with as_client("127.0.0.1", "session-a"), pytest.raises(Asked):
        tools.fork_from_branch("secret-work:1")  # its maker's, as before
