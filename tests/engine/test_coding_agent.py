"""recipes/coding-agent and `forkd demo coding-agent`: a source, a branch, three grandchildren
trying three fixes. The VM test runs the whole demo on real VMs (TCG here) and checks it from
the host too; the others check the recipe's project and the demo's checker without a VM."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.controller import coding_demo
from forkd.engine import recipe
from forkd.store.store import Store

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "coding-agent" / "recipe.toml"
TAG = "coding-agent:test"


def expected_data_sha256() -> str:
    """What the warm-up writes, computed on the host from the recipe's own constants."""
    warmup = recipe.load(RECIPE).warmup
    namespace: dict[str, object] = {}
    exec(  # the constants only: DATA_MIB and DATA_SEED
        "\n".join(ln for ln in warmup.splitlines() if ln.startswith(("DATA_MIB", "DATA_SEED"))),
        namespace,
    )
    rng, h = random.Random(namespace["DATA_SEED"]), hashlib.sha256()
    for _ in range(int(namespace["DATA_MIB"])):  # type: ignore[call-overload]
        h.update(rng.randbytes(1 << 20))
    return h.hexdigest()


def unittest_summary(project: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-B", "-m", "unittest"], cwd=project, capture_output=True, text=True
    )
    return [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]


def test_recipe_installs_the_project_and_the_fixes_get_their_results(tmp_path: Path):
    r = recipe.load(RECIPE)
    assert "git" in r.apt and r.disk_free_mib >= 64
    paths = {f.path for f in r.files}
    assert {"/work/repo/ledger/split.py", "/work/repo/tests/test_split.py"} <= paths
    project = tmp_path / "repo"
    shutil.copytree(coding_demo.recipe_dir() / "repo", project)
    assert unittest_summary(project) == coding_demo.SOURCE_EXPECTED  # the bug
    results = set()
    for fix in coding_demo.FIXES:
        (project / "ledger" / "split.py").write_text(fix.source)
        assert unittest_summary(project) == fix.expected, fix.name
        results.add((fix.name, fix.expected))
    assert len({fix.source for fix in coding_demo.FIXES}) == len(coding_demo.FIXES)


def _view(role: str, **changes: object) -> coding_demo.SandboxView:
    fix = {f.name: f for f in coding_demo.FIXES}.get(role)
    base = coding_demo.SandboxView(
        role=role,
        child_id=f"{role}-1",
        tests=fix.expected if fix else coding_demo.SOURCE_EXPECTED,
        tests_exit=0 if fix and fix.expected == "OK" else 1,
        data_sha256="d" * 64,
        data_bytes=50 << 20,
        split_sha256=coding_demo.sha256_text(fix.source if fix else coding_demo.original_split()),
        pycache={"ledger/__pycache__/split.cpython-311.pyc": role},
        notes=sorted({"NOTES-source.md", f"NOTES-{role}.md"}),
        head=f"{role}-head",
        branch=f"fix/{role}" if fix else "main",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_checker_flags_every_kind_of_leak():
    good = [_view("source"), *(_view(f.name) for f in coding_demo.FIXES)]
    report = coding_demo.CodingDemoReport("t", "b", 1.0, 2.0, good)
    assert coding_demo.check(report) == []
    leaks = {
        "data": (1, {"data_sha256": "e" * 64}),
        "edit": (0, {"split_sha256": coding_demo.sha256_text(coding_demo.FIXES[0].source)}),
        "note": (2, {"notes": ["NOTES-divmod.md", "NOTES-last-takes-rest.md", "NOTES-source.md"]}),
        "pycache": (3, {"pycache": {"ledger/__pycache__/split.cpython-311.pyc": "divmod"}}),
        "result": (1, {"tests": "FAILED (failures=1)"}),
        "head": (2, {"head": "divmod-head"}),
    }
    for what, (i, change) in leaks.items():
        views = list(good)
        views[i] = dataclasses.replace(views[i], **change)  # type: ignore[arg-type]
        problems = coding_demo.check(coding_demo.CodingDemoReport("t", "b", 1.0, 2.0, views))
        assert problems, f"a {what} leak went unnoticed"


@pytest.mark.vm
@pytest.mark.timeout(3600)  # builds the recipe into the session's store first (zstd 19, TCG)
def test_demo_on_real_vms(store: Store, engine_env: dict[str, Path], qemu_pids):
    if os.geteuid() != 0:
        pytest.skip("VM tests need root (debootstrap, cgroups)")
    from forkd.engine import children as ch
    from forkd.engine.build import build

    build(store, recipe.load(RECIPE), TAG)
    said: list[str] = []
    report = coding_demo.run(store, TAG, say=said.append)
    assert report.problems == [], report.problems
    source, *kids = report.sandboxes
    assert [v.role for v in kids] == [f.name for f in coding_demo.FIXES]
    # the 50 MiB file: the bytes the recipe generates, the same in all four
    want = expected_data_sha256()
    assert {v.data_sha256 for v in report.sandboxes} == {want}
    assert {v.data_bytes for v in report.sandboxes} == {50 << 20}
    # each its own edit, note, bytecode and test result; the source untouched
    assert source.tests == coding_demo.SOURCE_EXPECTED and source.tests_exit != 0
    assert source.notes == ["NOTES-source.md"] and source.branch == "main"
    for view, fix in zip(kids, coding_demo.FIXES, strict=True):
        assert view.split_sha256 == coding_demo.sha256_text(fix.source)
        assert view.notes == sorted(["NOTES-source.md", f"NOTES-{fix.name}.md"])
        assert view.tests == fix.expected and (view.tests_exit == 0) == (fix.expected == "OK")
    pycs = [v.pycache["ledger/__pycache__/split.cpython-311.pyc"] for v in report.sandboxes]
    assert len(set(pycs)) == 4
    assert len({v.head for v in report.sandboxes}) == 4
    # nothing left: children killed, the branch tag removed
    running = {c.id for c in ch.list_children()}
    assert not running & {v.child_id for v in report.sandboxes}
    assert report.branch_tag not in store.tags.read()
    for view in report.sandboxes:
        assert not qemu_pids(engine_env["FORKD_RUN"] / "children" / view.child_id)
