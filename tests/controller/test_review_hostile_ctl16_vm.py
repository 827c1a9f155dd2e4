"""Sandbox ids of 64 random bits under a run directory whose sockets' paths are past
AF_UNIX's 108 bytes (tests/controller/test_review_hostile_ctl16.py, 4), with real VMs (tiny
recipe): the build's QEMU and a child's start, the child's relay serves an exec, QMP ends
it. Longer ids had been taken back when this failed ('cannot start: AF_UNIX path too
long'). This test kills only the children it made and checks that none of them is left."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

TOKEN = "ctl16-vm-token-0123456789abcdef"
TINY_TAG = "ctl16/tiny:latest"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_run(env: dict[str, str]) -> Iterator[Path]:
    """This module's FORKD_RUN, long enough that a child's ``agent.sock`` is past 108 bytes."""
    run = Path(env["FORKD_RUN"]).parent / ("r" * 70) / "run"
    assert len(os.fsencode(f"{run}/children/tiny-{'0' * 16}/agent.sock")) > 108
    before = os.environ["FORKD_RUN"]
    os.environ["FORKD_RUN"] = str(run)
    try:
        yield run
    finally:
        os.environ["FORKD_RUN"] = before


@pytest.fixture(scope="module")
def built(long_run: Path) -> str:
    from forkd.engine import recipe
    from forkd.engine.build import build
    from forkd.store.store import Store

    build(Store.open(), recipe.load(REPO / "recipes" / "tiny.toml"), TINY_TAG)
    return TINY_TAG


@pytest.fixture
def mine(long_run: Path) -> Iterator[list[str]]:
    """The ids of the children this test made: killed at its end, and checked gone."""
    from forkd.engine import children as ch

    made: list[str] = []
    yield made
    for child_id in made:
        ch.kill(child_id)
    left = [c.id for c in ch.list_children() if c.id in made]
    assert left == [], f"children left behind: {left}"
    deadline = time.monotonic() + 15
    while (left := _processes_in(long_run, made)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a child's helper processes end just after its QEMU
    assert left == [], f"processes of this test's children are left: {left}"


def _processes_in(run: Path, ids: list[str]) -> list[str]:
    """The live processes whose command line names, or whose working directory is, one of
    these children's directories."""
    dirs = [f"{run}/children/{i}" for i in ids]
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, IndexError):
            continue
        if state != "Z" and any(d.encode() in cmdline or cwd == d for d in dirs):
            found.append(f"{pid}: {cmdline[:200]!r}")
    return found


def test_a_child_with_a_long_id_under_a_long_run_directory_runs(
        built: str, mine: list[str]) -> None:
    from forkd.engine import children as ch
    from forkd.store.store import Store

    forked = ch.fork(Store.open(), built, 1)
    mine.extend(c.id for c in forked.children)
    assert forked.errors == [] and len(mine) == 1
    child = forked.children[0]
    assert len(child.id.rsplit("-", 1)[1]) == 16
    qemu = Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")
    assert b"unix:qmp.sock,server=on,wait=off" in qemu  # bound relative to its directory
    ran = ch.exec_in(child.id, ["sh", "-c", "echo hello from $(hostname)"])
    assert (ran["exit_code"], ran["stdout"].startswith("hello from")) == (0, True), ran
    listed = {c.id: c.state() for c in ch.list_children()}
    assert listed[child.id] == "running"  # pid_matches knows its QEMU
