"""`forkd kill --all` and children.kill_all end this store's children only (issue 15): the
run directory holds every root user's children, each forked from their own $FORKD_HOME.
Crashed children (records of processes that are gone) are ended like any other, so this
needs no VM; tests/engine/test_kill_scope.py does the same with running ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkd.store.store import Store


def _crashed_child(run: Path, child_id: str, home: Path) -> None:
    """A child record whose QEMU is gone, forked (its memory image says) from ``home``."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    d = run / "children" / child_id
    d.mkdir(parents=True)
    record = {"id": child_id, "ref": "t:x", "digest": "sha256:" + "0" * 64, "pid": gone.pid,
              "dir": str(d), "memory": str(home / "cache" / ("a" * 64) / "memory.img"),
              "disk_backing": str(home / "cache" / ("a" * 64) / "disk.img"),
              "memory_mib": 64, "created": time.time()}
    (d / "child.json").write_text(json.dumps(record))


@pytest.fixture
def run_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    env = {"FORKD_HOME": tmp_path / "mine", "FORKD_RUN": tmp_path / "run"}
    env["FORKD_RUN"].mkdir(mode=0o700)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    _crashed_child(env["FORKD_RUN"], "mine-1", env["FORKD_HOME"])
    _crashed_child(env["FORKD_RUN"], "mine-2", env["FORKD_HOME"])
    _crashed_child(env["FORKD_RUN"], "theirs-1", tmp_path / "theirs")
    return env


def test_cli_kill_all_ends_only_this_store_s_children(run_env: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from forkd.cli.main import main; main()", "kill", "--all",
         "--json"],
        env={**os.environ, **{k: str(v) for k, v in run_env.items()}}, capture_output=True,
        text=True, stdin=subprocess.DEVNULL, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert sorted(c["id"] for c in json.loads(proc.stdout)) == ["mine-1", "mine-2"]
    assert f"1 children of other stores than {run_env['FORKD_HOME']}" in proc.stderr
    left = sorted(p.name for p in (run_env["FORKD_RUN"] / "children").iterdir())
    assert left == ["theirs-1"]


def test_engine_kill_all_is_scoped_the_same_way(run_env: dict[str, Path], tmp_path: Path,
                                                ) -> None:
    from forkd.engine import children as ch

    assert sorted(c.id for c in ch.kill_all()) == ["mine-1", "mine-2"]  # $FORKD_HOME's
    assert [c.id for c in ch.list_children()] == ["theirs-1"]
    assert [c.id for c in ch.kill_all(Store.open(tmp_path / "theirs"))] == ["theirs-1"]
    assert ch.list_children() == []
