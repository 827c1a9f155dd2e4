"""Real QEMU microVMs (TCG here): build, fork, exec/eval, isolation, branch, kill, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.store.store import Store

pytestmark = pytest.mark.vm


def _val(r: dict[str, Any]) -> object:
    assert r["error"] is None, r["error"]
    return r["value"]


def test_fork_exec_eval_unique_isolated(
    store: Store,
    tiny: str,
    cleanup_children: None,
) -> None:
    from forkd.engine import children as ch

    res = ch.fork(store, tiny, 5)
    assert len(res.children) == 5 and not res.errors
    ids = [c.id for c in res.children]
    assert len(set(ids)) == 5
    for c in res.children:
        assert c.timings_ms["ready"] > 0
        cmd = Path(f"/proc/{c.pid}/cmdline").read_bytes().split(b"\0")
        assert b"-sandbox" in cmd and b"share=off" in b" ".join(cmd)
        if os.geteuid() == 0:  # QEMU dropped root after start-up (-runas nobody)
            uid_line = Path(f"/proc/{c.pid}/status").read_text().split("Uid:")[1].split()
            assert uid_line[0] != "0" and uid_line[1] != "0"
    # the warm interpreter state from the recipe's warm-up is there
    for i in ids:
        assert _val(ch.eval_in(i, "WARM['ready']")) is True
        r = ch.exec_in(i, ["hostname"])
        assert r["exit_code"] == 0 and r["stdout"].strip() == i
    # unique entropy: kernel CRNG and Python's PRNG differ between children
    urandom = [_val(ch.eval_in(i, "import os; os.urandom(16).hex()")) for i in ids]
    prng = [_val(ch.eval_in(i, "import random; random.getrandbits(64)")) for i in ids]
    assert len(set(urandom)) == 5 and len(set(prng)) == 5
    # disk isolation: a write in one child is invisible to the others and to new children
    w = ch.exec_in(ids[0], ["sh", "-c",
                            "echo secret > /root/only-here && sync && cat /root/only-here"])
    assert w["exit_code"] == 0 and w["stdout"] == "secret\n"
    for i in ids[1:]:
        assert ch.exec_in(i, ["test", "-e", "/root/only-here"])["exit_code"] == 1
    fresh = ch.fork(store, tiny, 1).children[0]
    assert ch.exec_in(fresh.id, ["test", "-e", "/root/only-here"])["exit_code"] == 1
    # exec details: stdin, env, cwd, exit code, timeout
    r = ch.exec_in(ids[1], ["sh", "-c", "cat; echo $FOO; pwd; exit 7"], stdin=b"in\n",
                   env={"FOO": "bar"}, cwd="/tmp")
    assert (r["exit_code"], r["stdout"]) == (7, "in\nbar\n/tmp\n")
    t = ch.exec_in(ids[1], ["sleep", "30"], timeout=1)
    assert t["timed_out"] is True
    # file put/get through the agent
    with ch.agent(ids[3]) as a:
        a.put("/tmp/forkd-put.bin", bytes(range(256)) * 16, mode=0o600)
        assert a.get("/tmp/forkd-put.bin") == bytes(range(256)) * 16
        assert a.exec(["stat", "-c", "%a", "/tmp/forkd-put.bin"])["stdout"] == "600\n"
    # eval errors come back as structured errors, the child keeps serving
    e = ch.eval_in(ids[2], "1/0")
    assert e["error"]["type"] == "ZeroDivisionError"
    assert _val(ch.eval_in(ids[2], "6*7")) == 42


def test_other_shell_reaches_children(
    store: Store,
    tiny: str,
    cleanup_children: None,
    engine_env: dict[str, Path],
) -> None:
    from forkd.engine import children as ch

    env = {**os.environ, "FORKD_HOME": str(engine_env["FORKD_HOME"]),
           "FORKD_RUN": str(engine_env["FORKD_RUN"])}
    # another process, started outside the checkout (so the installed package is used)
    cli = [sys.executable, "-c", "from forkd.cli.main import main; main()"]
    cwd = engine_env["FORKD_RUN"].parent
    out = subprocess.run([*cli, "fork", tiny, "-n", "2", "--json"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr
    kids = json.loads(out.stdout)["children"]
    assert len(kids) == 2  # the forking process has exited; the children run on
    ls = json.loads(subprocess.run([*cli, "ls", "--json"], env=env, capture_output=True,
                                   text=True, check=True, cwd=cwd).stdout)
    assert {k["id"] for k in kids} <= {c["id"] for c in ls if c["status"] == "running"}
    r = subprocess.run([*cli, "exec", kids[0]["id"], "--", "sh", "-c", "echo hi; exit 3"],
                       env=env, capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 3 and r.stdout == "hi\n"
    r = subprocess.run([*cli, "eval", kids[1]["id"], "2**10"], env=env, capture_output=True,
                       text=True, cwd=cwd)
    assert r.returncode == 0 and r.stdout.strip() == "1024"
    r = subprocess.run([*cli, "kill", "--all"], env=env, capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0
    assert ch.list_children() == []


def test_branch_chain_and_grandchildren(
    store: Store,
    tiny: str,
    cleanup_children: None,
) -> None:
    from forkd.engine import children as ch
    from forkd.engine.branch import branch

    a = ch.fork(store, tiny, 1).children[0].id
    _val(ch.eval_in(a, "import hashlib, os\nX = bytearray(os.urandom(1 << 20) * 8)\n"
                       "H = hashlib.sha256(X).hexdigest()\nmarker = 'at-branch'"))
    assert ch.exec_in(a, ["sh", "-c", "echo b1 > /root/branch-file && sync"])["exit_code"] == 0
    b1 = branch(store, a, "tiny:b1")
    assert b1.depth == 1 and b1.diff_pages > 2048 and b1.pause_ms < 2000
    assert b1.parent == tiny
    # the source goes on changing after the branch
    _val(ch.eval_in(a, "marker = 'later'\nX[:] = b'z' * len(X)"))
    ch.exec_in(a, ["sh", "-c", "echo later > /root/branch-file && sync"])
    gk = ch.fork(store, "tiny:b1", 2).children
    for g in gk:
        got = _val(ch.eval_in(g.id, "[marker, hashlib.sha256(X).hexdigest() == H, "
                                    "open('/root/branch-file').read()]"))
        assert got == ["at-branch", True, "b1\n"]
    # grandchildren are unique too
    assert len({_val(ch.eval_in(g.id, "os.urandom(8).hex()")) for g in gk}) == 2
    # branch of a branch of a branch: depth 3
    _val(ch.eval_in(gk[0].id, "marker = 'b2'"))
    assert branch(store, gk[0].id, "tiny:b2").depth == 2
    c3 = ch.fork(store, "tiny:b2", 1).children[0].id
    _val(ch.eval_in(c3, "marker = 'b3'"))
    b3 = branch(store, c3, "tiny:b3")
    assert b3.depth == 3
    g3 = ch.fork(store, "tiny:b3", 1).children[0].id
    assert _val(ch.eval_in(g3, "[marker, open('/root/branch-file').read()]")) == ["b3", "b1\n"]
    # automatic compaction: past the store's depth limit the new layer is flattened
    compacting = Store(store.home, auto_compact_depth=2)
    _val(ch.eval_in(g3, "marker = 'b4'"))
    b4 = branch(compacting, g3, "tiny:b4")
    assert b4.compacted and b4.depth == 0
    g4 = ch.fork(store, "tiny:b4", 1).children[0].id
    assert _val(ch.eval_in(g4, "[marker, open('/root/branch-file').read()]")) == ["b4", "b1\n"]


def test_kill_leaves_nothing_and_crash_is_reported(
    store: Store,
    tiny: str,
    engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    from forkd.engine import children as ch
    from forkd.engine.errors import ChildDead, ChildNotFound

    kids = ch.fork(store, tiny, 2, memory_limit_mib=512).children
    a, b = kids
    cg = Path(a.cgroup or "")
    assert cg.is_dir()
    limit = (cg / "memory.max") if (cg / "memory.max").exists() else cg / "memory.limit_in_bytes"
    assert int(limit.read_text()) == 512 << 20
    assert a.pid in [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    ch.kill(a.id)
    assert not Path(a.dir).exists() and not cg.exists()
    assert a.pid not in qemu_pids(engine_env["FORKD_RUN"])
    with pytest.raises(ChildNotFound):
        ch.exec_in(a.id, ["true"])
    with pytest.raises(ChildNotFound):
        ch.kill(a.id)
    # a child whose QEMU dies is reported as crashed, refuses requests, and kill cleans it up
    os.kill(b.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while ch.get(b.id).state() != "crashed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.status for c in ch.list_children() if c.id == b.id] == ["crashed"]
    with pytest.raises(ChildDead):
        ch.eval_in(b.id, "1")
    assert ch.kill(b.id).status == "crashed"
    assert not Path(b.dir).exists() and not Path(b.cgroup or "").exists()
    assert qemu_pids(engine_env["FORKD_RUN"]) == []
    assert [p.name for p in (engine_env["FORKD_RUN"] / "children").iterdir()] == []


def test_bad_input(
    store: Store,
    tiny: str,
    cleanup_children: None,
) -> None:
    from forkd.engine import children as ch

    with pytest.raises(NotFound):
        ch.fork(store, "no-such:tag", 1)
    for n in (0, -3):
        with pytest.raises(InvalidInput):
            ch.fork(store, tiny, n)
    with pytest.raises(InvalidInput):
        ch.exec_in("../etc", ["true"])
    assert ch.list_children() == []


def _copy_into(store: Store, tiny: str, tmp_path: Path, **compat_changes: object) -> Store:
    from forkd.store.store import Store

    other = Store.open(tmp_path / "other")
    asm = store.assemble(tiny)
    assert asm.config.compat is not None
    compat = replace(asm.config.compat, **compat_changes)  # type: ignore[arg-type]
    other.import_layer("copy:x", memory=asm.memory, vmstate=asm.vmstate, disk=asm.disk,
                       compat=compat, files=asm.files)
    return other


def test_corrupt_blob_refused_before_any_vm(
    store: Store,
    tiny: str,
    tmp_path: Path,
    engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    from forkd.engine import children as ch

    other = _copy_into(store, tiny, tmp_path)
    man = other.manifest(other.resolve("copy:x"))
    mem_chunks = [d for d in man.chunks]
    assert mem_chunks
    for d in mem_chunks:
        p = other.blobs.path(d.digest)
        os.chmod(p, 0o644)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    before = qemu_pids(engine_env["FORKD_RUN"])
    with pytest.raises(IntegrityError):
        ch.fork(other, "copy:x", 2)
    assert qemu_pids(engine_env["FORKD_RUN"]) == before
    assert ch.list_children() == []


def test_incompatible_snapshot_refused_before_any_vm(
    store: Store,
    tiny: str,
    tmp_path: Path,
    engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    from forkd.engine import children as ch
    from forkd.engine.errors import HostError

    other = _copy_into(store, tiny, tmp_path, accelerators=["firecracker-kvm"], vmm_version="99.0")
    with pytest.raises(HostError, match=r"QEMU 99\.0"):
        ch.fork(other, "copy:x", 1)
    assert qemu_pids(engine_env["FORKD_RUN"]) == []
    assert ch.list_children() == []


def test_build_is_cached(
    store: Store,
    tiny: str,
    tiny_recipe: Path,
) -> None:
    from forkd.engine import recipe
    from forkd.engine.build import build

    res = build(store, recipe.load(tiny_recipe), tiny)
    assert res.cached  # found, not built again (was also: in < 10 s, a speed goal)
    cfg = store.config(store.resolve(tiny))
    assert cfg.compat is not None and cfg.compat.machine == "microvm"
    assert cfg.compat.accelerators == [res.accel] and cfg.recipe is not None


def test_a_build_in_another_store_leaves_this_stores_cache(
    store: Store,
    tiny: str,
    tiny_recipe: Path,
) -> None:
    """Another store building the same recipe rewrites the user's shared build record; this
    store still finds the snapshot it built (its own record) and does not rebuild."""
    import json

    from forkd.engine import recipe
    from forkd.engine.build import cached_snapshot
    from forkd.engine.paths import cache_dir

    mine = store.resolve(tiny)
    theirs = "sha256:" + "0" * 64  # what another store's build of this recipe recorded
    shared = [f for f in (cache_dir() / "builds").glob("*.json")
              if json.loads(f.read_text())["digest"] == mine]
    assert shared, "the build left no shared record"
    for f in shared:
        f.write_text(json.dumps({"ref": tiny, "digest": theirs}))
    assert cached_snapshot(store, recipe.load(tiny_recipe)) == mine
