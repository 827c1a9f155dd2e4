"""A snapshot's access order recorded before it is published: one child forked lazily
from the local store (every chunk is local, so nothing is fetched), brought up to its
agent's answer (and ``probe`` evaluated, when given), killed; the chunks its lazy server
saw it need, in order. Published as the pack's access-order artifact (orders.publish),
it lets even the first lazy fork on a new host prefetch its working set from the start.
"""

from __future__ import annotations

import itertools
import time

from forkd.engine import children as ch
from forkd.engine.errors import HostError
from forkd.engine.lazy import orders
from forkd.engine.lazy.chunks import ChunkSource
from forkd.engine.lazy.fork import READY_TIMEOUT, assembled, holding
from forkd.engine.lazy.paths import server_dir
from forkd.engine.lazy.prefetch import load_order
from forkd.engine.qemu import pid_alive
from forkd.pack import accessorder
from forkd.registry.client import RegistryClient
from forkd.store.store import Store


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


def publish_order(store: Store, tag: str, client: RegistryClient, repo: str,
                  probe: str | None = None) -> str:
    """Record ``tag``'s access order (record_order) and push it next to its manifest in
    ``repo`` (pushed before), with its working set (the recorded chunks in one blob);
    the order artifact's digest."""
    head = store.resolve(tag)
    order = record_order(store, tag, probe)
    held = list(itertools.takewhile(store.blobs.has, order.chunks))  # all, in a publisher
    return orders.publish(client, repo, head, accessorder.encode(head, order),
                          orders.WorkingSet(store, held) if held else None)


__all__ = ["publish_order", "record_order"]
