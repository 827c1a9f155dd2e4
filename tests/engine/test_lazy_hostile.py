"""Hostile review of the lazy-fork client side (round 1): a hostile hub or pack author, and
what a killed lazy fork leaves behind, against the real chunk source, prefetch and store
(no VM).

* A chunk whose stored bytes match the digest its map names but whose content does not
  match the map's blake3 (a hostile pack author's map) could reach the store unchecked
  (the fork command's ``WorkingSetFetch`` stores chunks by digest only, as does a pull
  killed between its fetch and its check); the server's prefetch counted such a chunk as
  here and tagged the chain: a pack that ``forkd pull`` refuses became a local tag that
  forks and pushes on. The prefetch now checks the content of every chunk of the chain
  it has not decoded itself before it tags, and tags nothing when one fails.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hostile_hub import HostileHub
from hostile_packs import chunk, layer

from forkd import digest as dg
from forkd.engine.lazy import prefetch
from forkd.engine.lazy.chunks import ChunkSource, Hub, open_remote
from forkd.pack.imagemap import CHUNK_PAGES, ImageMap
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.store.store import Store

TAG = "evil/app:v1"


def _lying_pack(hub_store: Store) -> tuple[str, str]:
    """A one-layer pack on ``hub_store`` whose second chunk's map names the blake3 of other
    bytes than the chunk holds: (head manifest digest, that chunk's digest)."""
    good, good_blob = chunk([(0, CHUNK_PAGES)], 1)
    bad, bad_blob = chunk([(CHUNK_PAGES, 4)], 2)
    bad = replace(bad, blake3=dg.blake3_of(b"not these pages"))
    imap = ImageMap("flat", 2 * CHUNK_PAGES * 4096, (good, bad))
    pack = layer("app:v1", imap, {good.digest: good_blob, bad.digest: bad_blob})
    for data in (pack.manifest, *pack.blobs.values()):
        hub_store.blobs.put_bytes(data)
    return pack.digest, bad.digest


def test_a_chunk_stored_unchecked_is_checked_before_the_chain_is_tagged(
        tmp_path: Path) -> None:
    """The fork command brings a recorded chunk into the store by its digest alone (its
    content is checked when read); the server's prefetch then finds it local. Before: it
    tagged the chain ("done") with a chunk whose content the map refuses in it. Now: the
    prefetch fails naming the chunk, and no tag is made."""
    hub_store = Store(tmp_path / "hub")
    head, bad = _lying_pack(hub_store)
    fresh = Store(tmp_path / "fresh")
    with HostileHub(hub_store, {"v1": head}) as hostile, \
            RegistryClient(hostile.hub) as client:
        remote = parse_remote(f"{hostile.hub.host}/evil/app:v1")
        command = open_remote(fresh, remote, client)
        assert command.fetch_into_store(bad)  # WorkingSetFetch, in the fork command
        assert fresh.blobs.has(bad)
        server = ChunkSource(fresh, fresh.chain(head, TAG), TAG, Hub(client, remote.name))
        progress = prefetch.Progress()
        prefetch.run(server, prefetch.plan(server, [bad], list(server.refs)), 1, progress,
                     tmp_path / "prefetch.json", TAG)
        server.close()
    assert TAG not in fresh.tags.read()
    assert progress.state == "failed" and bad in (progress.error or ""), progress
