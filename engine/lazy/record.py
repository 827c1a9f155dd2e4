"""A snapshot's access order recorded before it is published: one child forked lazily
from the local store (every chunk is local, so nothing is fetched), brought up to its
agent's answer (and ``probe`` evaluated, when given), killed; the chunks its lazy server
saw it need, in order. Published as the pack's access-order artifact (orders.publish),
it lets even the first lazy fork on a new host prefetch its working set from the start.

Before that, ``split_working_set`` records the pages a local child of the snapshot touches
up to its first answer (the guest-RAM mapping's pagemap) and splits the layer's memory
chunks by them (forkd.store.worksplit): the working set published with the order is then
the chunks of those pages alone, not the 2 MiB regions around them.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from forkd.engine import build
from forkd.engine import children as ch
from forkd.engine.branch import touched_pages
from forkd.engine.errors import HostError
from forkd.engine.lazy import orders
from forkd.engine.lazy.chunks import ChunkSource
from forkd.engine.lazy.fork import READY_TIMEOUT, assembled, holding
from forkd.engine.lazy.paths import server_dir
from forkd.engine.lazy.prefetch import load_order
from forkd.engine.precopy import ram_mapping
from forkd.engine.qemu import pid_alive
from forkd.pack import accessorder
from forkd.pack.imagemap import PAGE_SIZE, runs
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
    source = ChunkSource(store, store.chain(head, tag), tag)
    with holding(store, source, None, None, prefetch=False) as snap:
        result = ch.fork(store, tag, 1, assembled=assembled(store, source, snap),
                         overlay_template=snap.overlay)
        try:
            if not result.children:
                raise HostError(f"recording the access order of {tag}: the child did not "
                                f"start: {'; '.join(result.errors)}")
            if probe is not None:
                ch.eval_in(result.children[0].id, probe)
        finally:
            for child in result.children:
                ch.kill(child.id, store)
    deadline = time.monotonic() + READY_TIMEOUT
    while pid_alive(snap.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # it writes order.json as it exits, a second after the kill
    found = load_order(order_file, head)
    if found is None or not found.chunks:
        raise HostError(f"the lazy server of {tag} recorded no access order; see "
                        f"{order_file.parent / 'server.log'}")
    return found


def record_touched(store: Store, tag: str, probe: str | None = None) -> list[int]:
    """The memory pages one local child of ``tag`` has touched (read or written) when it
    first answers (and has evaluated ``probe``, when given), in page order: what its
    guest-RAM mapping holds then (engine.branch.touched_pages)."""
    result = ch.fork(store, tag, 1)
    if not result.children:
        raise HostError(f"recording the pages {tag} touches: the child did not start: "
                        f"{'; '.join(result.errors)}")
    child = result.children[0]
    try:
        if probe is not None:
            ch.eval_in(child.id, probe)
        start, end, offset = ram_mapping(child.pid, Path(child.memory))
        first = offset // PAGE_SIZE
        return [first + i for i in touched_pages(child.pid, start, end)]
    finally:
        ch.kill(child.id, store)


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
    """The chunks of ``order`` its working-set blob holds, first: with the pages a child
    touched (split_working_set), the memory chunks holding any of them and the order's
    other chunks (disk, device state), the memory chunks only the kernel's read-ahead
    around those pages needed left for the prefetch; without, every recorded chunk."""
    touched = load_touched(store, head)
    if touched is None:
        return order.chunks
    memory = store.image_map(store.manifest(head), "memory", head)
    if memory is None:
        return order.chunks
    cold = {c.digest for c in memory.chunks if not any(p in touched for p in pages_of(c))}
    return [d for d in order.chunks if d not in cold]


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
