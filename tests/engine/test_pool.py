"""The prewarmed pool (engine/pool.py) with real VMs of the tiny recipe."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkd.engine import children as ch
from forkd.engine.cgroup import detect
from forkd.engine.paths import children_dir
from forkd.engine.pool import MAX_POOL, Pool, sweep_orphans
from forkd.engine.qemu import pid_alive
from forkd.errors import InvalidInput, NotFound
from forkd.store.store import Store

pytestmark = pytest.mark.vm


@pytest.fixture
def pool(store: Store, tiny: str, cleanup_children: None) -> Iterator[Pool]:
    p = Pool(store)
    try:
        yield p
    finally:
        p.close()


def _leftovers(ids: list[str], run: Path, qemu_pids: Callable[[Path], list[int]]) -> list[str]:
    """Anything of these waiting processes still on the host: QEMU, directory, cgroup."""
    out = [
        f"qemu pid {pid}"
        for pid in qemu_pids(run)
        if any(i.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() for i in ids)
    ]
    out += [f"dir {i}" for i in ids if (children_dir() / i).exists()]
    out += [f"dir {d.name}" for d in children_dir().iterdir() if d.name.startswith(".pool-")]
    found = detect()
    if found is not None:
        out += [f"cgroup {i}" for i in ids if (found[1] / "forkd" / i).exists()]
    return out


def _urandom(child_id: str) -> str:
    value = ch.eval_in(child_id, "import os; os.urandom(16).hex()")["value"]
    assert isinstance(value, str)
    return value


def test_pooled_spawn_is_ready_unique_and_the_pool_refills(pool: Pool, store: Store, tiny: str):
    status = pool.fill(tiny, 3)
    assert (status["target"], status["waiting"], status["starting"]) == (3, 3, 0)
    waiting = [w.id for w in pool._pools[status["tag"]].waiting]
    assert not {c.id for c in ch.list_children()} & set(waiting)  # not children yet
    res = ch.fork(store, tiny, 4, pool=pool)  # 3 from the pool, 1 started as usual
    assert not res.errors and len(res.children) == 4
    ids = [c.id for c in res.children]
    assert set(waiting) <= set(ids)
    pooled = [c for c in res.children if c.id in waiting]
    assert all("prestarted_ms" in c.timings_ms for c in pooled)
    assert all(c.state() == "running" for c in res.children)
    values = {_urandom(i) for i in ids}
    assert len(values) == 4  # fresh entropy in each, pooled or not
    prng = {ch.eval_in(i, "import random; random.random()")["value"] for i in ids}
    assert len(prng) == 4  # and reseeded Python PRNGs
    assert ch.exec_in(pooled[0].id, ["hostname"])["stdout"].strip() == pooled[0].id
    assert {c.id for c in ch.list_children()} >= set(ids)
    pool.wait_filled(tiny, 120)
    again = pool.status()[0]
    assert (again["waiting"], again["taken"]) == (3, 3)
    assert not set(w.id for w in pool._pools[again["tag"]].waiting) & set(ids)


def test_drain_leaves_nothing_behind(
    store: Store, tiny: str, engine_env: dict[str, Path], qemu_pids: Callable[[Path], list[int]]
):
    pool = Pool(store)
    try:
        pool.fill(tiny, 2, memory_limit_mib=256)
        other = Pool(store, restore_ahead=False)
        other.fill(tiny, 1)
        ids = [w.id for tp in (*pool._pools.values(), *other._pools.values()) for w in tp.waiting]
        assert len(ids) == 3
        assert all((children_dir() / i / ch.WAITING_FILE).exists() for i in ids)
        other.close()
        pool.fill(tiny, 4, memory_limit_mib=256, wait=False)  # close while starting
    finally:
        pool.close()
    pool.close()  # idempotent
    ids += [d.name for d in children_dir().iterdir() if (d / ch.WAITING_FILE).exists()]
    assert _leftovers(ids, engine_env["FORKD_RUN"], qemu_pids) == []
    assert not [d for d in children_dir().iterdir() if (d / ch.WAITING_FILE).exists()]
    with pytest.raises(Exception, match="closed"):
        pool.fill(tiny, 1)


def test_retagged_snapshot_is_never_handed_out_stale(pool: Pool, store: Store, tiny: str):
    from forkd.engine.branch import branch

    src = ch.fork(store, tiny, 1).children[0]
    ch.exec_in(src.id, ["/bin/sh", "-c", "echo v1 > /tmp/marker; sync"])
    first = branch(store, src.id, "tinypool:moving")
    pool.fill("tinypool:moving", 2)
    stale = [w.id for w in pool._pools["tinypool:moving"].waiting]
    ch.exec_in(src.id, ["/bin/sh", "-c", "echo v2 > /tmp/marker; sync"])
    second = branch(store, src.id, "tinypool:moving", force=True)
    assert second.digest != first.digest
    res = ch.fork(store, "tinypool:moving", 2, pool=pool)
    assert not set(stale) & {c.id for c in res.children}
    assert all(c.digest == second.digest for c in res.children)
    for c in res.children:
        assert ch.exec_in(c.id, ["cat", "/tmp/marker"])["stdout"] == "v2\n"
    pool.wait_filled("tinypool:moving", 120)
    status = next(s for s in pool.status() if s["tag"] == "tinypool:moving")
    assert status["digest"] == second.digest and status["waiting"] == 2
    deadline = time.monotonic() + 30  # the stale ones are killed in the background
    while any((children_dir() / i).exists() for i in stale):
        assert time.monotonic() < deadline, "stale waiting processes were not removed"
        time.sleep(0.05)


def test_bad_input_is_refused(pool: Pool, store: Store, tiny: str):
    with pytest.raises(InvalidInput):
        pool.fill(tiny, -1)
    with pytest.raises(InvalidInput):
        pool.fill(tiny, MAX_POOL + 1)
    with pytest.raises(NotFound):
        pool.fill("ghost:none", 1)
    assert pool.status() == []
    assert pool.take(tiny, 1, digest="sha256:" + "0" * 64) == []
    assert pool.remove("ghost:none") is False


def test_sweep_removes_processes_of_a_dead_owner(
    store: Store, tiny: str, engine_env: dict[str, Path], qemu_pids: Callable[[Path], list[int]]
):
    pool = Pool(store, restore_ahead=False)
    try:
        pool.fill(tiny, 1)
        deadline = time.monotonic() + 120
        while True:  # the launch records the QEMU pid last: edit the file after that
            tp = next(iter(pool._pools.values()), None)
            if tp is not None and tp.waiting:
                w = tp.waiting[0]
                f = w.info.path / ch.WAITING_FILE
                raw = json.loads(f.read_text()) if f.exists() else {}
                if raw.get("pid"):
                    break
            assert time.monotonic() < deadline, "the pool never launched its process"
            time.sleep(0.05)
        raw["owner"] = 2**22 + 7  # no such process: its owner died without draining
        f.write_text(json.dumps(raw))
        assert sweep_orphans() == [w.id]
        # Dead (a zombie until its parent, this test, reaps it). Not vm.alive(): Popen.poll()
        # answers None while another thread holds the process's wait lock.
        assert not w.info.path.exists() and not pid_alive(raw["pid"])
    finally:
        pool.close()
    assert _leftovers([w.id], engine_env["FORKD_RUN"], qemu_pids) == []
    assert os.getpid()  # the test process itself is untouched


@pytest.fixture(scope="module")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available()
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    return build(store, recipe.parse(text, src="tiny+network"), "tiny-net:pool").ref


def test_pooled_children_of_a_nic_snapshot_get_their_own_identity(
    store: Store, tiny_net: str, cleanup_children: None
):
    from forkd.engine import netns

    pool = Pool(store)
    try:
        assert pool.fill(tiny_net, 2)["netns"] is True  # a NIC snapshot always needs one
        kids = ch.fork(store, tiny_net, 2, pool=pool).children
        assert all("prestarted_ms" in k.timings_ms for k in kids)
        for k in kids:
            assert k.netns and netns.exists(k.netns) and k.mac and k.ip
            mac = ch.exec_in(k.id, ["cat", "/sys/class/net/eth0/address"])["stdout"].strip()
            assert mac == k.mac
        assert len({k.mac for k in kids}) == 2
        pool.wait_filled(tiny_net, 120)
        refilled = [w.info.netns for tp in pool._pools.values() for w in tp.waiting]
        assert len(refilled) == 2 and all(n and netns.exists(n) for n in refilled)
    finally:
        pool.close()
    assert not any(n and netns.exists(n) for n in refilled)
