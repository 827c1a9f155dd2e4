"""A snapshot's access order recorded before it is published: one child forked lazily
from the local store (every chunk is local, so nothing is fetched), brought up to its
agent's answer (and ``probe`` evaluated, when given), killed; the chunks its lazy server
saw it need, in order. Published as the pack's access-order artifact (orders.publish),
it lets even the first lazy fork on a new host prefetch its working set from the start.

Before that, ``split_working_set`` records the pages a child of the snapshot touches up to
its first answer (``record_touched``: a lazy child whose server records each page it
reads, one at a time) and splits the layer's memory chunks by them
(forkd.store.worksplit): the working set published with the order is then the chunks of
those pages alone, not the 2 MiB regions around them.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from forkd.engine import build
from forkd.engine import children as ch
from forkd.engine.errors import HostError
from forkd.engine.lazy import orders
from forkd.engine.lazy.chunks import ChunkSource
from forkd.engine.lazy.fork import READY_TIMEOUT, assembled, holding
from forkd.engine.lazy.paths import PAGES_FILE, server_dir
from forkd.engine.lazy.prefetch import load_order
from forkd.engine.qemu import pid_alive
from forkd.pack import accessorder
from forkd.pack.imagemap import runs
from forkd.registry.client import RegistryClient
from forkd.store.store import Store
from forkd.store.worksplit import pages_of, split_memory

TOUCHED_FILE = "touched.json"  # in the snapshot's lazy directory: the pages, as runs


def record_order(store: Store, tag: str, probe: str | None = None) -> accessorder.Order:
    """The chunks (and memory windows) a lazy child of local ``tag`` needs up to its
    first answer (``probe``: code it evaluates too), in the order it first needs them.
    Kept as the snapshot's order.json in the store's lazy directory: a second call reads
    it."""
    head = store.resolve(tag)
    order_file = server_dir(store.home, head) / "order.json"
    found = load_order(order_file, head)
    if found is not None and found.chunks:
        return found
    _one_child(store, tag, probe, record_pages=False)
    found = load_order(order_file, head)
    if found is None or not found.chunks:
        raise HostError(f"the lazy server of {tag} recorded no access order; see "
                        f"{order_file.parent / 'server.log'}")
    return found


def record_touched(store: Store, tag: str, probe: str | None = None) -> list[int]:
    """The memory pages one child of ``tag`` has touched (read or written) when it first
    answers (and has evaluated ``probe``, when given), in page order. The child is a lazy
    one of the local chain whose server records the pages it reads with the mount's
    read-ahead off and nothing pushed around them, its QEMU without the huge-page advice
    (hugepages.py): each page the guest touches is read once, alone. (The pages a local
    child's mapping holds count the kernel's fault-around too, 64 KiB around each touch
    whose neighbours are cached: 73 MiB where the guest touched 40, for langgraph-react.)"""
    head = store.resolve(tag)
    d = _one_child(store, tag, probe, record_pages=True)
    doc = _load(d / PAGES_FILE, head)
    try:
        pages = [] if doc is None else [first + i for first, n in doc["pages"]
                                        for i in range(n)]
    except (KeyError, TypeError, ValueError):
        pages = []
    if not pages:
        raise HostError(f"the lazy server of {tag} recorded no page its child touched; see "
                        f"{d / 'server.log'}")
    return pages


def _one_child(store: Store, tag: str, probe: str | None, record_pages: bool) -> Path:
    """One lazy child of local ``tag`` (every chunk is here: nothing is fetched) up to
    its first answer and ``probe``, killed; its server waited for, for what it keeps as
    it exits (order.json; pages.json with record_pages); the server's directory."""
    head = store.resolve(tag)
    source = ChunkSource(store, store.chain(head, tag), tag)
    with holding(store, source, None, None, prefetch=False,
                 record_pages=record_pages) as snap:
        result = ch.fork(store, tag, 1, assembled=assembled(store, source, snap),
                         overlay_template=snap.overlay)
        try:
            if not result.children:
                raise HostError(f"recording what a child of {tag} touches: the child did "
                                f"not start: {'; '.join(result.errors)}")
            if probe is not None:
                ch.eval_in(result.children[0].id, probe)
        finally:
            for child in result.children:
                ch.kill(child.id, store)
    deadline = time.monotonic() + READY_TIMEOUT
    while pid_alive(snap.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # it writes its files as it exits, a second after the kill
    return snap.dir


def split_working_set(store: Store, tag: str, probe: str | None = None) -> str:
    """Move ``tag`` to its layer with the memory chunks split by the pages a child touches
    up to its first answer (record_touched, forkd.store.worksplit), and keep those pages
    with it (``touched.json`` in its lazy directory: publish_order's working set); the
    layer's digest."""
    old = store.resolve(tag)
    if load_touched(store, old) is not None:
        return old  # split already
    touched = record_touched(store, tag, probe)
    head = split_memory(store, tag, touched)
    _save(server_dir(store.home, head) / TOUCHED_FILE, {"manifest": head, "from": old,
                                                       "pages": runs(touched)})
    build.rerecord(store, old, head)  # a build of the same recipe finds the split layer
    return head


def _save(path: Path, doc: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def _load(path: Path, head: str) -> dict[str, Any] | None:
    """A JSON object saved for manifest ``head``, or None."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("manifest") == head else None


def split_from(store: Store, head: str) -> str | None:
    """The layer split_working_set made ``head`` from, when this store still holds it."""
    doc = _load(server_dir(store.home, head) / TOUCHED_FILE, head)
    old = doc.get("from") if doc is not None else None
    return old if isinstance(old, str) and store.blobs.has(old) else None


def load_touched(store: Store, head: str) -> set[int] | None:
    """The pages split_working_set recorded for ``head``, or None."""
    doc = _load(server_dir(store.home, head) / TOUCHED_FILE, head)
    try:
        return None if doc is None else {first + i for first, n in doc["pages"]
                                         for i in range(n)}
    except (KeyError, TypeError, ValueError):
        return None


def working_set(store: Store, head: str, order: accessorder.Order) -> list[str]:
    """The chunks a working-set blob holds, first: with the pages a child touched
    (split_working_set), the order's chunks but the memory chunks holding none of them
    (only the kernel's read-ahead around those pages needed those: left for the
    prefetch), then every other memory chunk holding a touched page; without, every
    recorded chunk.

    A touched page's chunk can be missing from the order: the recording child's server
    put it into the page cache with the window around an earlier read (memfs ``_push``),
    so the child never read it. A child on another host, whose server has no such chunk
    to push, reads it from the hub: 10 to 20 ms each, before its first answer."""
    touched = load_touched(store, head)
    if touched is None:
        return order.chunks
    memory = store.image_map(store.manifest(head), "memory", head)
    if memory is None:
        return order.chunks
    warm = [c.digest for c in memory.chunks if any(p in touched for p in pages_of(c))]
    cold = {c.digest for c in memory.chunks}.difference(warm)
    listed = [d for d in order.chunks if d not in cold]
    held = set(listed)
    return listed + [d for d in dict.fromkeys(warm) if d not in held]


def publish_order(store: Store, tag: str, client: RegistryClient, repo: str,
                  probe: str | None = None) -> str:
    """Record ``tag``'s access order (record_order) and push it next to its manifest in
    ``repo`` (pushed before), with its working set in one blob (working_set: the chunks
    of the pages a child touched when split_working_set recorded them, else every
    recorded chunk) at its front; the order artifact's digest."""
    head = store.resolve(tag)
    order = record_order(store, tag, probe)
    first = working_set(store, head, order)
    held_first = set(first)
    rest = [d for d in order.chunks if d not in held_first]
    order = accessorder.Order(first + rest, order.windows)
    held = accessorder.bounded_prefix(  # all are here, in a publisher
        list(itertools.takewhile(store.blobs.has, first)), store.blobs.size)
    return orders.publish(client, repo, head, accessorder.encode(head, order),
                          orders.WorkingSet(store, held) if held else None)


__all__ = ["publish_order", "record_order", "record_touched", "split_working_set"]
