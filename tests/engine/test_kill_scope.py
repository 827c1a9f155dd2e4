"""`forkd kill --all` kills the children of this store only (issue 15): every root user's
children share /run/forkd, each with their own $FORKD_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from forkd.store.store import Store


def _twin_store(store: Store, tiny: str, home: Path) -> Store:
    """Another store holding the same snapshot (its images are assembled under its home)."""
    other = Store.open(home)
    asm = store.assemble(tiny)
    other.import_layer("other:x", memory=asm.memory, vmstate=asm.vmstate, disk=asm.disk,
                       compat=asm.config.compat, files=asm.files)
    return other


def test_kill_all_spares_other_stores_children(
    store: Store,
    tiny: str,
    tmp_path: Path,
    engine_env: dict[str, Path],
    cleanup_children: None,
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    from forkd.engine import children as ch

    other = _twin_store(store, tiny, tmp_path / "other-home")
    mine = ch.fork(store, tiny, 2).children
    theirs = ch.fork(other, "other:x", 1).children[0]
    try:
        assert [c.id for c in ch.list_children() if ch.of_store(c.memory, store)] == sorted(
            c.id for c in mine)
        env = {**os.environ, "FORKD_HOME": str(store.home),
               "FORKD_RUN": str(engine_env["FORKD_RUN"])}
        cli = [sys.executable, "-c", "from forkd.cli.main import main; main()"]
        r = subprocess.run([*cli, "kill", "--all", "--json"], env=env, capture_output=True,
                           text=True, timeout=120, cwd=engine_env["FORKD_RUN"].parent)
        assert r.returncode == 0, r.stderr
        assert sorted(c["id"] for c in json.loads(r.stdout)) == sorted(c.id for c in mine)
        assert f"1 children of other stores than {store.home}" in r.stderr
        left = ch.list_children()
        assert [(c.id, c.status) for c in left] == [(theirs.id, "running")]
        assert ch.exec_in(theirs.id, ["true"])["exit_code"] == 0
        assert ch.kill_all(store) == []  # the engine's kill_all is scoped the same way
        assert [c.id for c in ch.kill_all(other)] == [theirs.id]
    finally:
        for c in ch.list_children():
            ch.kill(c.id, other)
    assert ch.list_children() == []
    assert qemu_pids(engine_env["FORKD_RUN"]) == []
