"""`forkd fork HUB/NS/NAME --lazy` with real QEMU and a real hub started here: children of
a pack this store has never seen behave like eager ones; a gone hub fails only the child
that faults on a missing chunk (named); a chunk the hub corrupts is never served; the
prefetch completes and children keep running. docs/engine.md, "Lazy fork"."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hub_server import HubServer

from forkd.engine import children as ch
from forkd.engine.errors import ChildDead, VMMError
from forkd.engine.lazy.paths import PAGES_FILE, server_dir
from forkd.errors import ForkdError
from forkd.store.store import Store

pytestmark = [pytest.mark.vm, pytest.mark.timeout(3600)]  # the tiny build, on a loaded host
PREFETCH_TIMEOUT = 300.0


def _val(r: dict[str, Any]) -> object:
    assert r["error"] is None, r["error"]
    return r["value"]


@dataclass
class Published:
    hub: HubServer
    remote: str  # HUB/NS/NAME:TAG
    local: str  # the tag the lazy path gives it once complete
    fresh: Store  # a store that has never seen the pack
    who: tuple[str, str]  # the publisher (push right on lazy/tiny)
    pushed_head: str  # the manifest pushed


@pytest.fixture
def published(store: Store, tiny: str, tmp_path: Path,
              lazy_mounts: Callable[..., list[str]]) -> Iterator[Published]:
    """The tiny snapshot pushed to a hub of this test (public: no login needed), and an
    empty store to fork it lazily into; its children and lazy server are gone after."""
    hub = HubServer(tmp_path / "hub").start()
    fresh = Store(tmp_path / "fresh")
    try:
        who = hub.add_user("lazy")
        hub.push(store, tiny, "lazy/tiny:v1", who)
        hub.public("lazy/tiny")
        yield Published(hub, f"{hub.address}/lazy/tiny:v1", "lazy/tiny:v1", fresh, who,
                        store.resolve(tiny))
    finally:
        ch.kill_all(fresh)
        hub.stop()
    assert lazy_mounts(fresh.home) == []  # the server unmounted after its last child


def _vm_flags(pid: int, memory: Path) -> list[str]:
    """The VmFlags (/proc/PID/smaps) of a process's mapping of ``memory``."""
    from forkd.engine.precopy import ram_mapping

    start = ram_mapping(pid, memory)[0]
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = int(line.split("-")[0], 16) == start
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no VmFlags for the mapping of {memory} in process {pid}")


def _server_dir(fresh: Store) -> Path:
    return next((fresh.home / "lazy").iterdir())


def _prefetch(fresh: Store) -> dict[str, Any]:
    report = _server_dir(fresh) / "prefetch.json"
    deadline = time.monotonic() + PREFETCH_TIMEOUT
    while time.monotonic() < deadline:
        if report.exists():
            got: dict[str, Any] = json.loads(report.read_text())
            if got["state"] in ("done", "failed"):
                return got
        time.sleep(0.5)
    raise AssertionError(f"prefetch did not finish in {PREFETCH_TIMEOUT} s")


def test_lazy_children_behave_like_eager(published: Published, cleanup_children: None,
                                         lazy_mounts: Callable[..., list[str]]) -> None:
    from forkd.engine.branch import branch
    from forkd.engine.lazy import fork as lazy

    fresh = published.fresh
    res = lazy.fork(fresh, published.remote, 3)
    assert len(res.children) == 3 and not res.errors
    ids = [c.id for c in res.children]
    for c in res.children:  # mapped private from the lazy server's FUSE file
        cmd = b" ".join(Path(f"/proc/{c.pid}/cmdline").read_bytes().split(b"\0"))
        assert b"share=off" in cmd and b"/mnt/memory.img" in cmd
        # started without QEMU's huge-page advice: a first touch reads its page, not 4 MiB
        assert "hg" not in _vm_flags(c.pid, Path(c.memory)), "the advice took effect"
    assert not list(fresh.cache_dir.glob("*/memory.img"))  # no assembly on this path
    for i in ids:
        assert _val(ch.eval_in(i, "WARM['ready']")) is True
        assert ch.exec_in(i, ["hostname"])["stdout"].strip() == i
    urandom = [_val(ch.eval_in(i, "import os; os.urandom(16).hex()")) for i in ids]
    prng = [_val(ch.eval_in(i, "import random; random.getrandbits(64)")) for i in ids]
    assert len(set(urandom)) == 3 and len(set(prng)) == 3
    w = ch.exec_in(ids[0], ["sh", "-c", "echo secret > /root/only-here && sync"])
    assert w["exit_code"] == 0
    for i in ids[1:]:
        assert ch.exec_in(i, ["test", "-e", "/root/only-here"])["exit_code"] == 1

    # the prefetch brings the rest of the chain and tags it; children run on unchanged
    got = _prefetch(fresh)
    assert got["state"] == "done" and got["tagged"] == published.local, got
    assert fresh.resolve(published.local) == res.children[0].digest
    assert fresh.verify() == []
    order = json.loads((_server_dir(fresh) / "order.json").read_text())
    assert order["manifest"] == res.children[0].digest and order["chunks"]
    for i in ids:
        assert _val(ch.eval_in(i, "6*7")) == 42
    assert ch.exec_in(ids[0], ["cat", "/root/only-here"])["stdout"] == "secret\n"

    # branch a lazy child, then fork the branch (eagerly: the chain is local now)
    _val(ch.eval_in(ids[1], "marker = 'lazy-branch'"))
    ch.exec_in(ids[1], ["sh", "-c", "echo b1 > /root/branch-file && sync"])
    b = branch(fresh, ids[1], "lazy/tiny:b1")
    assert b.depth == 1 and b.parent == published.local
    for g in ch.fork(fresh, "lazy/tiny:b1", 2).children:
        got_g = _val(ch.eval_in(g.id, "[marker, open('/root/branch-file').read()]"))
        assert got_g == ["lazy-branch", "b1\n"]
    # a second lazy fork of the same snapshot reuses its server: one mount
    again = lazy.fork(fresh, published.remote, 1).children[0]
    assert Path(again.memory) == Path(res.children[0].memory)
    assert len(lazy_mounts(fresh.home, wait=0)) == 1


def test_an_order_recorded_at_publish_time_is_prefetched_by_the_first_lazy_fork(
        published: Published, store: Store, tiny: str, cleanup_children: None) -> None:
    """record.publish_order: the publisher's own lazy child records the working set and
    pushes it with the pack (the order, the memory windows it read, the recorded chunks
    in one blob); the very first lazy fork on a new store fetches the order and brings
    those chunks in that blob's one request from the start (without it the first fork
    has no recorded order)."""
    from forkd.engine.lazy import fork as lazy
    from forkd.engine.lazy import orders, record
    from forkd.engine.lazy.chunks import ChunkSource

    head = store.resolve(tiny)
    with published.hub.forkd_client(published.who) as client:
        record.publish_order(store, tiny, client, "lazy/tiny")
        order = orders.fetch(client, "lazy/tiny", head)
    assert order is not None and order.chunks, "no access order on the hub"
    assert order.windows, "the order names no memory window the child read"
    chunks = order.chunks
    assert set(chunks) <= set(ChunkSource(store, store.chain(head, tiny), tiny).refs)
    res = lazy.fork(published.fresh, published.remote, 1)
    assert len(res.children) == 1 and not res.errors
    got = _prefetch(published.fresh)
    assert got["state"] == "done" and got["recorded"] == len(chunks), got
    assert got["streamed"] == len(chunks), "the working set did not come in its one request"
    # it came through the spool the command streamed it into, which is gone once read
    spec = json.loads((_server_dir(published.fresh) / "server.json").read_text())
    assert spec["working_set_spool"], spec
    assert not Path(spec["working_set_spool"]).exists()
    assert _val(ch.eval_in(res.children[0].id, "6*7")) == 42


def test_hub_gone_fails_only_the_faulting_child(published: Published,
                                                cleanup_children: None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from forkd.engine.lazy import fork as lazy

    fresh = published.fresh
    with caplog.at_level("DEBUG", logger="forkd.lazy.fork"):
        res = lazy.fork(fresh, published.remote, 2, prefetch=False)
    phases = [r.getMessage().split(": ", 1)[1].rsplit(" at ", 1)[0] for r in caplog.records
              if r.name == "forkd.lazy.fork"]
    assert phases == ["chain resolved", "server ready", "2 children forked"], phases
    a, b = (c.id for c in res.children)
    for _ in range(3):  # b's code paths are in memory before the hub goes
        assert _val(ch.eval_in(b, "6*7")) == 42
    published.hub.stop()
    # a touches most of its memory: free guest pages are not zero, their chunks are not here
    with pytest.raises(ForkdError):
        ch.eval_in(a, "X = bytearray(120 << 20)\nlen(X)", timeout=120)
    with pytest.raises(ChildDead, match=r"chunk sha256:[0-9a-f]{64}.*hub"):
        ch.eval_in(a, "1")
    assert _val(ch.eval_in(b, "6*7")) == 42  # the other child lives on
    assert fresh.verify() == []  # what arrived is sound (nothing is tagged: incomplete)
    assert fresh.tags.read() == {}


def test_corrupt_chunk_from_the_hub_is_never_served(published: Published,
                                                    cleanup_children: None) -> None:
    from forkd.engine.lazy import fork as lazy
    from forkd.engine.lazy.chunks import open_remote
    from forkd.registry.client import RegistryClient
    from forkd.registry.reference import parse_remote

    fresh = published.fresh
    remote = parse_remote(published.remote)
    with RegistryClient(remote.hub) as client:
        memory = {d for d, (_, what) in open_remote(Store(fresh.home.parent / "probe"),
                                                    remote, client).refs.items()
                  if " memory chunk " in what}
    hub_dir = published.hub.data_dir
    for digest in memory:  # every memory chunk on the hub's disk gets one byte flipped
        path = next(hub_dir.rglob(digest.split(":")[1]))
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(VMMError, match=r"chunk sha256:[0-9a-f]{64}.*digest mismatch") as caught:
        lazy.fork(fresh, published.remote, 1, prefetch=False)
    named = {d for d in memory if d in str(caught.value)}
    assert named, caught.value
    for digest in memory:
        assert not fresh.blobs.has(digest)  # refused: never stored
    assert fresh.verify() == []


def test_push_access_order_on_the_command_line(published: Published, store: Store, tiny: str,
                                                tmp_path: Path, cleanup_children: None) -> None:
    """`forkd push TAG REMOTE --access-order` (logged in with `forkd login`): TAG's memory
    chunks are split by the pages a child touches (the tag names the new layer, the same
    image), the pack and its recorded working set (the chunks of those pages and no
    other memory chunk) reach the hub, and the first lazy fork of a new store prefetches
    that order from the start."""
    import os
    import subprocess

    from forkd.engine.lazy import fork as lazy
    from forkd.engine.lazy import orders, record
    from forkd.pack.accessorder import working_set_chunks
    from forkd.store.worksplit import pages_of

    env = {**os.environ, "FORKD_CREDENTIALS": str(tmp_path / "creds.json")}
    hub = published.hub.address
    login = subprocess.run(["forkd", "login", hub, "-u", published.who[0], "--password-stdin"],
                           input=published.who[1] + "\n", text=True, capture_output=True,
                           env=env, timeout=60)
    assert login.returncode == 0, login.stderr
    pushed = subprocess.run(["forkd", "push", tiny, f"{hub}/lazy/ordered:v1", "--access-order",
                             "--json"], text=True, capture_output=True, env=env, timeout=900,
                            stdin=subprocess.DEVNULL)
    assert pushed.returncode == 0, pushed.stderr
    head = store.resolve(tiny)
    assert head != published.pushed_head and "by its working set" in pushed.stderr
    touched = record.load_touched(store, head)
    # recorded by a lazy child whose server kept each page it read (record.record_touched)
    kept = json.loads((server_dir(store.home, published.pushed_head) / PAGES_FILE).read_text())
    assert touched == {first + i for first, n in kept["pages"] for i in range(n)}
    memory = store.image_map(store.manifest(head), "memory", head)
    assert touched and memory is not None
    for chunk in memory.chunks:  # each wholly touched or wholly not
        assert len({p in touched for p in pages_of(chunk)}) == 1, chunk
    published.hub.public("lazy/ordered")
    with published.hub.forkd_client(published.who) as client:
        order = orders.fetch(client, "lazy/ordered", head)
    assert order is not None and order.chunks, "the pushed pack has no access order on the hub"
    assert order.working_set is not None
    stored = {c.digest: c.stored for link in store.chain(head)
              for role in ("memory", "disk")
              if (m := store.image_map(link.manifest, role, link.digest)) is not None
              for c in m.chunks}
    held = working_set_chunks(order.chunks, stored, order.working_set.size, "working set")
    cold = {c.digest for c in memory.chunks if not touched & set(pages_of(c))}
    assert held and not cold & set(held)
    assert {c.digest for c in memory.chunks} - cold <= set(held)  # every touched page's
    chunks = order.chunks
    res = lazy.fork(published.fresh, f"{hub}/lazy/ordered:v1", 1)
    assert len(res.children) == 1 and not res.errors
    got = _prefetch(published.fresh)
    assert got["state"] == "done" and got["recorded"] == len(chunks), got
    assert _val(ch.eval_in(res.children[0].id, "6*7")) == 42


def test_a_branch_right_after_a_lazy_fork_waits_for_the_chain(published: Published,
                                                               cleanup_children: None) -> None:
    """A branch stacks a layer on the tag the child was forked from, which exists once the
    prefetch has brought the whole chain: a branch at once waits for it, then forks like
    any. With the prefetch off the chain never completes here: the branch says to pull."""
    from forkd.engine.branch import branch
    from forkd.engine.lazy import fork as lazy
    from forkd.errors import Conflict

    res = lazy.fork(published.fresh, published.remote, 1)
    child = res.children[0].id
    b = branch(published.fresh, child, "lazy/tiny:right-away")  # no wait for the prefetch
    assert b.parent == published.local
    assert published.fresh.resolve(published.local) == res.children[0].digest
    grandchild = ch.fork(published.fresh, "lazy/tiny:right-away", 1).children[0]
    assert _val(ch.eval_in(grandchild.id, "6*7")) == 42

    on_demand = Store(published.fresh.home.parent / "on-demand")
    try:
        lone = lazy.fork(on_demand, published.remote, 1, prefetch=False).children[0]
        with pytest.raises(Conflict, match="forkd pull"):
            branch(on_demand, lone.id, "lazy/tiny:never")
    finally:
        ch.kill_all(on_demand)
