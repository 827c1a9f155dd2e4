"""A chunk's content is decoded to check it once per store (forkd.store.checks): a pull of
a pack that shares chunks with one the store holds decoded every shared chunk again, as
did every lazy fork's prefetch before it tagged (a pack sharing a 1 GiB base: seconds of
CPU each time). The store now records each chunk it checked, with what it decoded to, and
a pull or a prefetch checks only the rest. A map naming a recorded chunk with another
content (a lying map) is still checked and refused; gc removes the records of the chunks
it removes. Against a real HTTP hub (tests/hostile_hub.py) and the real pull, chunk
source and prefetch; the check itself is counted by wrapping the one function that does
it (forkd.pack.chunking.unpack_chunk), which still runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hostile_hub import HostileHub
from hostile_packs import chunk, layer

from forkd import digest as dg
from forkd.engine.lazy import chunks as lazy_chunks
from forkd.engine.lazy import prefetch
from forkd.engine.lazy.chunks import ChunkSource, Hub, open_remote
from forkd.errors import IntegrityError
from forkd.pack.imagemap import CHUNK_PAGES, CHUNK_SIZE, ImageMap
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import pull
from forkd.store import fetch
from forkd.store.store import Store

SHARED, OWN_A, OWN_B = (chunk([(0, CHUNK_PAGES)], 1), chunk([(CHUNK_PAGES, CHUNK_PAGES)], 2),
                        chunk([(CHUNK_PAGES, CHUNK_PAGES)], 3))


def publish(store: Store, tag: str, refs: list[tuple[Any, bytes]]) -> str:
    """A one-layer pack of ``refs`` (chunk ref, stored bytes) on ``store``: its digest."""
    imap = ImageMap("flat", 2 * CHUNK_SIZE, tuple(r for r, _ in refs))
    pack = layer(tag, imap, {r.digest: b for r, b in refs})
    for data in (pack.manifest, *pack.blobs.values()):
        store.blobs.put_bytes(data)
    return pack.digest


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HostileHub]:
    publisher = Store(tmp_path / "publisher")
    tags = {"a": publish(publisher, "app:a", [SHARED, OWN_A]),
            "b": publish(publisher, "app:b", [SHARED, OWN_B])}
    lying = replace(SHARED[0], blake3=dg.blake3_of(b"other pages"))
    tags["lie"] = publish(publisher, "app:lie", [(lying, SHARED[1]), OWN_B])
    with HostileHub(publisher, tags) as served:
        yield served


def counted(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[str]:
    """The chunks ``module`` decodes to check (its unpack_chunk, wrapped; it still runs)."""
    decoded: list[str] = []
    real: Callable[..., bytes] = module.unpack_chunk

    def unpack_chunk(blob: bytes, ref: Any, what: str) -> bytes:
        decoded.append(ref.digest)
        return real(blob, ref, what)

    monkeypatch.setattr(module, "unpack_chunk", unpack_chunk)
    return decoded


def pull_tag(store: Store, hub: HostileHub, tag: str) -> None:
    with RegistryClient(hub.hub) as client:
        pull(store, parse_remote(f"{hub.hub.host}/acme/app:{tag}"), client)


def test_a_pull_decodes_only_the_chunks_the_store_has_not_checked(
        tmp_path: Path, hub: HostileHub, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "home")
    decoded = counted(monkeypatch, fetch)
    pull_tag(store, hub, "a")
    assert sorted(decoded) == sorted([SHARED[0].digest, OWN_A[0].digest])
    decoded.clear()
    pull_tag(store, hub, "b")
    assert decoded == [OWN_B[0].digest]  # the shared chunk was checked by the first pull
    assert store.assemble("acme/app:b").memory.read_bytes()[:1] == b"\x01"


def test_a_map_that_names_a_checked_chunk_with_other_content_is_still_refused(
        tmp_path: Path, hub: HostileHub) -> None:
    store = Store(tmp_path / "home")
    pull_tag(store, hub, "a")
    with pytest.raises(IntegrityError, match=SHARED[0].digest):
        pull_tag(store, hub, "lie")
    assert "acme/app:lie" not in store.tags.read()


def test_gc_removes_the_records_of_the_chunks_it_removes(tmp_path: Path,
                                                          hub: HostileHub) -> None:
    store = Store(tmp_path / "home")
    pull_tag(store, hub, "a")
    pull_tag(store, hub, "b")
    records = tmp_path / "home" / "checked"
    assert len(list(records.iterdir())) == 3
    store.remove("acme/app:a")
    store.gc()
    left = sorted(p.name.split(".")[0] for p in records.iterdir())
    assert left == sorted(dg.hex_part(r.digest) for r in (SHARED[0], OWN_B[0]))


def test_a_lazy_prefetch_checks_only_the_chunks_the_store_has_not_checked(
        tmp_path: Path, hub: HostileHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that pulled ``a`` forks ``b`` lazily; the fork command brought ``b``'s own
    chunk in by its digest alone (WorkingSetFetch). Before tagging, the prefetch checks
    what is unchecked: ``b``'s own chunk, not the one ``a``'s pull checked."""
    store = Store(tmp_path / "home")
    pull_tag(store, hub, "a")
    tag = "acme/app:b"
    with RegistryClient(hub.hub) as client:
        remote = parse_remote(f"{hub.hub.host}/{tag}")
        command = open_remote(store, remote, client)
        assert command.fetch_into_store(OWN_B[0].digest)
        decoded = counted(monkeypatch, lazy_chunks)
        head = hub.tags["b"]
        server = ChunkSource(store, store.chain(head, tag), tag, Hub(client, remote.name))
        progress = prefetch.Progress()
        prefetch.run(server, prefetch.plan(server, [], list(server.refs)), 1, progress,
                     tmp_path / "prefetch.json", tag)
        server.close()
    assert progress.state == "done", progress
    assert decoded == [OWN_B[0].digest]
    assert store.tags.read()[tag] == head
