"""The controller against the twelfth hostile review: what a guest's answer makes a tool
result hold, and what a branch may write to the host's disk. No VM: the real MCP tools on
the real in-process backend and a fake guest agent (daemon_support.FakeGuest); a child
record whose "QEMU" is a process this test starts, and a store on a small tmpfs (root)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import FakeGuest
from mcp.server.mcpserver.exceptions import ToolError

from forkd.controller import mcp
from forkd.controller.api import BranchRequest
from forkd.controller.backend import LocalBackend
from forkd.controller.sdk import Controller
from forkd.engine.agent_client import REQUEST_CLIENT
from forkd.engine.errors import ChildNotFound
from forkd.engine.lifecycle import ChildInfo
from forkd.engine.paths import children_dir
from forkd.errors import Conflict, NotFound
from forkd.store.fetch import ROOM_RESERVE, NoRoom
from forkd.store.store import Store
from forkd.synthetic import write_base

MIB = 1 << 20
# the fake guest's sandboxes were made by no MCP client: these tests use any sandbox
ANY_SANDBOX = mcp.SandboxScope(everything=True)


def _result_chars(result: object) -> int:
    """Characters of an MCP tool result as its client gets them (every content block)."""
    dumped = result.model_dump(mode="json", by_alias=True)  # type: ignore[attr-defined]
    return len(json.dumps(dumped))


# -- what a cell's result carries to the model -------------------------------------------
def test_a_run_code_result_is_bounded_whatever_the_guest_answers(
        place: Path, guest: FakeGuest) -> None:
    """Only stdout and stderr were bounded: the guest makes a cell's error, repr, value and
    rich results, and a result carries them twice (JSON text, structured content), so a
    45 MB answer was an 80 MB tool result in the model's context (130 MB at the agent's
    64 MiB line). Now they share mcp.MAX_CELL_CHARS, most useful first, and
    ``other_cut_chars`` says how much was left out."""
    big = "x" * (2 * MIB)
    png = base64.b64encode(b"\x89PNG" + b"\0" * (MIB + 1)).decode()
    guest.answer = {"stdout": "", "stderr": "", "value": [big], "repr": big,
                    "error": {"type": "E", "message": big, "traceback": big},
                    "results": [{"text": big, "html": big, "markdown": big, "svg": big,
                                 "latex": big, "json": [big], "png": png}] * 2}
    result = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX).run_code("sb-1", "1")
    assert _result_chars(result) < 12 * MIB  # 80 MB before
    cell = result.structured_content
    assert cell is not None
    assert cell["error"]["type"] == "E"
    assert cell["error"]["message"] == big  # the most useful part first, whole
    assert len(cell["error"]["traceback"]) == mcp.MAX_CELL_CHARS - 1 - len(big)
    assert cell["repr"] == "" and cell["value"] is None  # nothing was left for them
    assert all(r["png"] is None for r in cell["results"])  # an image fits whole or not at all
    assert not [c for c in result.content if c.type == "image"]
    listed = len(json.dumps([big]))
    assert cell["other_cut_chars"] == 1 + len(big) + listed + 2 * (5 * len(big) + listed
                                                                    + len(png))


def test_a_deeply_nested_value_is_not_indented_into_gigabytes(
        place: Path, guest: FakeGuest) -> None:
    """The result's text was the cell's JSON with ``indent=1``: each level of nesting adds
    a space to every line inside it, so a value 100 lists deep (600 KB as the guest sent
    it, well within the agent's bounds) became 60 MB of text in the MCP server (and the
    model's context); 8 MiB of such structure, gigabytes. The text is compact JSON now."""
    value: object = [0] * 200_000
    for _ in range(100):
        value = [value]
    guest.answer = {"stdout": "", "stderr": "", "value": value, "repr": "v", "error": None,
                    "results": []}
    result = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX).run_code("sb-1", "v")
    assert result.structured_content is not None
    assert result.structured_content["value"] == value  # it fits: given whole
    assert _result_chars(result) < 3 * len(json.dumps(value))


def test_a_value_too_deep_to_send_is_left_out(place: Path, guest: FakeGuest) -> None:
    """A value nested past 253 levels cannot be sent as a tool result (the MCP SDK's
    pydantic refuses it: the client got the JSON-RPC error "Circular reference detected
    (depth exceeded)", and none of the cell's output). Such a value (and a rich result's
    ``json``) past mcp.MAX_CELL_DEPTH is left out, counted in ``other_cut_chars``, and the
    rest of the result is sent."""
    value: object = [0]
    for _ in range(300):
        value = [value]
    guest.answer = {"stdout": "out", "stderr": "", "value": value, "repr": "deep",
                    "error": None, "results": [{"text": "t", "json": value}]}
    result = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX).run_code("sb-1", "v")
    result.model_dump_json(by_alias=True)  # what the transport does with it
    cell = result.structured_content
    assert cell is not None
    assert cell["value"] is None and cell["results"][0]["json"] is None
    assert cell["stdout"] == "out" and cell["repr"] == "deep"
    assert cell["other_cut_chars"] == 2 * len(json.dumps(value))


# -- what a branch may write to the host's disk -------------------------------------------
@pytest.fixture
def small_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A store on a tmpfs with 8 MiB past the reserve (fetch.ROOM_RESERVE), holding
    ``tiny:latest`` (one small layer), unmounted after the test."""
    where = tmp_path / "small"
    where.mkdir()
    size = (ROOM_RESERVE + (8 << 20)) >> 10
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k", "tmpfs",
                              str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        monkeypatch.setenv("FORKD_HOME", str(where / "home"))
        store = Store.open()
        image = tmp_path / "tiny.img"
        write_base(image, 1 << 20, seed=5, random_share=1.0)
        store.import_layer("tiny:latest", memory=image)
        yield store
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_branch_that_cannot_fit_is_refused_before_anything_is_copied(
        place: Path, small_store: Store) -> None:
    """A branch (and a pause, which is one) wrote the child's changed memory and disk into
    the store until the filesystem was full: a sandbox that dirtied its memory and filled
    its disk, branched again and again under new tags (REST, or branch_sandbox from an MCP
    client), filled the disk every sandbox, pause and pull of the host shares. It is
    refused first now (NoRoom, naming what it needs and how to make room), as a pull
    that cannot fit is; the child is not touched (its QMP is never reached)."""
    d = children_dir() / "sb-1"
    d.mkdir()
    qemu = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                             str(d / "qmp.sock")], start_new_session=True)
    try:
        ChildInfo(id="sb-1", ref="tiny:latest", digest=small_store.resolve("tiny:latest"),
                  pid=qemu.pid, dir=str(d), memory=str(d / "mem"), disk_backing="-",
                  memory_mib=128, created=time.time()).save()
        with pytest.raises(NoRoom) as refused:
            LocalBackend(small_store).branch("sb-1", BranchRequest(tag="mine:b1"))
        said = str(refused.value)
        assert "branching child sb-1" in said and "128 MiB of memory" in said, said
        assert "forkd gc" in said, said
        assert "mine:b1" not in small_store.tags.read()
    finally:
        qemu.kill()
        qemu.wait()


# -- which tags an MCP client may replace -------------------------------------------------
@pytest.fixture
def based(place: Path, tmp_path: Path) -> Store:
    """The store of this test's FORKD_HOME, holding ``base:latest`` and ``other:latest``."""
    store = Store.open()
    for i, tag in enumerate(("base:latest", "other:latest")):
        image = tmp_path / f"{i}.img"
        write_base(image, 1 << 20, seed=10 + i, random_share=1.0)
        store.import_layer(tag, memory=image)
    return store


def test_an_mcp_client_cannot_replace_a_snapshot_it_did_not_branch(based: Store) -> None:
    """branch_sandbox's ``force`` replaced any tag: a model that a prompt injection told to
    branch its sandbox as ``base:latest`` with force made every sandbox forked from it
    after, by any client of the daemon, start in a state the injection's author chose.
    Now force replaces only a tag this client made with branch_sandbox here; any other
    existing tag is a tool error before the sandbox is touched, and stays as it was."""
    before = based.resolve("base:latest")
    tools = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX)
    with pytest.raises(Conflict) as refused:
        tools.branch_sandbox("sb-1", "base", force=True)
    assert "not a branch this client made with branch_sandbox" in str(refused.value)
    assert based.resolve("base:latest") == before
    # a tag that does not exist needs no force: the branch is tried (no such sandbox here)
    with pytest.raises(NotFound, match="sb-1"):
        tools.branch_sandbox("sb-1", "new", force=True)


def test_an_mcp_client_replaces_its_own_branches(
        based: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tags a client made with branch_sandbox stay its to replace (force), through
    the same server; another client of it cannot (REQUEST_CLIENT: an HTTP client's
    address). The engine's branch here tags an existing layer (no VM)."""
    from forkd.controller import backend as backend_mod
    from forkd.engine.agent_client import REQUEST_CLIENT
    from forkd.engine.branch import BranchResult

    def branch(store: Store, child_id: str, tag: str, force: bool = False) -> BranchResult:
        digest = store.resolve("other:latest")
        store.tag(tag, "other:latest", force=force)
        return BranchResult(ref=tag, digest=digest, parent="other:latest", mode="live",
                            pause_ms=0, pause_pages=0, copy_ms=0, rounds=1, forced=False,
                            scan_ms=0, read_ms=0, devstate_ms=0, diff_pages=0, diff_bytes=0,
                            stored_bytes=0, store_ms=0, depth=1, compacted=False)

    monkeypatch.setattr(backend_mod, "branch_child", branch)
    tools = mcp.Tools(Controller(local=True), scope=ANY_SANDBOX)
    mine = REQUEST_CLIENT.set("10.0.0.1")
    try:
        tools.branch_sandbox("sb-1", "exp:1")
        tools.branch_sandbox("sb-1", "exp:1", force=True)  # its own: replaced
    finally:
        REQUEST_CLIENT.reset(mine)
    theirs = REQUEST_CLIENT.set("10.0.0.2")
    try:
        with pytest.raises(Conflict):
            tools.branch_sandbox("sb-1", "exp:1", force=True)
    finally:
        REQUEST_CLIENT.reset(theirs)


# -- which sandboxes a client's tools reach ----------------------------------------------
def test_the_tools_reach_only_the_sandboxes_their_client_may_use(
        place: Path, guest: FakeGuest) -> None:
    """Every tool acted on any sandbox of the daemon: a model under a prompt injection read
    the files of sandboxes other clients and jobs run, ran commands in one whose egress
    carries the host's keys (which MCP's own create_sandboxes never binds) or killed them.
    Now a client's tools reach the sandboxes it created on this server and the ones the
    operator named (``forkd mcp --sandbox ID``; ``--all-sandboxes`` for every one): any
    other is ChildNotFound, and its guest hears nothing."""
    served = mcp.build_server(Controller(local=True))
    calls = [("run_command", {"command": "cat /root/.netrc"}), ("run_code", {"code": "1"}),
             ("read_file", {"path": "/root/notes"}),
             ("write_file", {"path": "/root/x", "content": "y"}),
             ("branch_sandbox", {"tag": "stolen:one"}), ("kill_sandbox", {})]
    for tool, args in calls:
        with pytest.raises(ToolError, match="no child sb-1 among the sandboxes this MCP"):
            asyncio.run(asyncio.wait_for(
                served.call_tool(tool, {"sandbox_id": "sb-1", **args}), 10))
    assert guest.requests == []
    scope = mcp.SandboxScope(["sb-2"])
    scope.made(["sb-3"])
    assert [scope.allows(i) for i in ("sb-1", "sb-2", "sb-3")] == [False, True, True]
    assert mcp.SandboxScope(everything=True).allows("sb-1")


def test_a_sandbox_one_http_client_made_is_not_anothers() -> None:
    """Through `forkd mcp --transport http` every client shares the server: what one
    created is not another's to use (REQUEST_CLIENT tells them apart, as for their
    shares)."""
    scope = mcp.SandboxScope()
    with _as_client("10.0.0.1"):
        scope.made(["sb-1"])
        assert scope.allows("sb-1")
    with _as_client("10.0.0.2"):
        assert not scope.allows("sb-1")
        with pytest.raises(ChildNotFound, match="no child sb-1"):
            scope.check("sb-1")


@contextlib.contextmanager
def _as_client(address: str) -> Iterator[None]:
    mark = REQUEST_CLIENT.set(address)
    try:
        yield
    finally:
        REQUEST_CLIENT.reset(mark)


def test_forkd_mcp_refuses_a_malformed_sandbox_to_name() -> None:
    done = subprocess.run([sys.executable, "-c", "from forkd.cli.main import main; main()",
                           "mcp", "--sandbox", "../snapshots/x"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, cwd="/")
    assert done.returncode != 0
    assert "--sandbox" in done.stderr and "sandbox ids are 1-64" in done.stderr, done.stderr
