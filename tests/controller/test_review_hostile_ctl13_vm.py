"""FORKD_DISK_BUDGET with real children (tests/controller/test_review_hostile_ctl13.py, 7):
the budget admits what fits, refuses the rest by name before a QEMU starts, and an
admitted child writes its disk as usual. Real VMs (tiny recipe); this test kills only the
children it made and checks that none of them is left."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TOKEN = "ctl13-vm-token-0123456789abcdef"
TINY_TAG = "ctl13/tiny:latest"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(env: dict[str, str]) -> str:
    from forkd.engine import recipe
    from forkd.engine.build import build
    from forkd.store.store import Store

    build(Store.open(Path(env["FORKD_HOME"])), recipe.load(REPO / "recipes" / "tiny.toml"),
          TINY_TAG)
    return TINY_TAG


@pytest.fixture
def mine(env: dict[str, str]) -> Iterator[list[str]]:
    """The ids of the children this test made: killed at its end, and checked gone."""
    from forkd.engine import children as ch

    made: list[str] = []
    yield made
    for child_id in made:
        ch.kill(child_id)
    left = [c.id for c in ch.list_children() if c.id in made]
    assert left == [], f"children left behind: {left}"
    run = env["FORKD_RUN"]
    deadline = time.monotonic() + 15
    while (left := _processes_of(run, made)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a child's helper processes end just after its QEMU
    assert left == [], f"processes of this test's children are left: {left}"


def _processes_of(run: str, ids: list[str]) -> list[str]:
    """The live processes whose command line names one of these children's directories."""
    dirs = [f"{run}/children/{i}".encode() for i in ids]
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(d in cmdline for d in dirs):
            found.append(f"{pid}: {cmdline[:200]!r}")
    return found

def test_the_budget_admits_what_fits_and_refuses_the_rest_by_name(
        built: str, mine: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.engine import children as ch
    from forkd.engine import disk_budget
    from forkd.store.store import Store

    store = Store.open()
    first = ch.fork(store, built, 1)
    mine.extend(c.id for c in first.children)
    most = disk_budget.most(Path(first.children[0].dir) / "disk.qcow2")
    monkeypatch.setenv("FORKD_DISK_BUDGET", str(2 * most + most // 2))  # room for one more
    second = ch.fork(store, built, 2)
    mine.extend(c.id for c in second.children)
    assert len(second.children) == 1
    assert len(second.errors) == 1 and "FORKD_DISK_BUDGET" in second.errors[0]
    refused = second.errors[0].split(":", 1)[0]
    assert not (Path(first.children[0].dir).parent / refused).exists()  # nothing left of it
    admitted = second.children[0].id
    wrote = ch.exec_in(admitted, ["sh", "-c", "dd if=/dev/urandom of=/root/f bs=1M "
                                  "count=8 2>/dev/null && sync && wc -c < /root/f"])
    assert (wrote["exit_code"], wrote["stdout"].strip()) == (0, str(8 << 20))
    with pytest.raises(disk_budget.DiskBudgetExceeded, match="FORKD_DISK_BUDGET"):
        ch.fork(store, built, 1)  # every child refused: the fork's error is the budget's
