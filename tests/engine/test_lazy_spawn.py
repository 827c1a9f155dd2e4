"""A lazy server process started before its snapshot is known (``fork.Spawn``): it loads,
then serves the directory named on its stdin, its output moved to that directory's
server.log; told nothing (EOF) or cancelled it ends, leaving no process and no log."""

from __future__ import annotations

from pathlib import Path

from forkd.engine.lazy.fork import Spawn


def test_spawn_at_eof_exits_and_leaves_nothing() -> None:
    spawn = Spawn()
    assert spawn.proc.stdin is not None
    spawn.proc.stdin.close()
    assert spawn.proc.wait(120) == 0
    assert not spawn.log.exists()


def test_cancelled_spawn_leaves_nothing() -> None:
    spawn = Spawn()
    spawn.cancel()
    assert spawn.proc.returncode is not None
    assert not spawn.log.exists()


def test_spawn_told_its_directory_logs_there(tmp_path: Path) -> None:
    """It runs the server on that directory (here one without a server.json: it fails,
    and says so in the directory's server.log, not in the spawn log)."""
    spawn = Spawn()
    proc = spawn.go(tmp_path)
    assert proc.wait(120) != 0
    assert not spawn.log.exists()
    said = (tmp_path / "server.log").read_text()
    assert "server.json" in said, said
