"""A chain that cannot fit where the store keeps its blobs is refused before a byte of it
is fetched (forkd/store/fetch.py check_room): a pack import, a pull and a lazy fork's
source, on a real small filesystem (a tmpfs), against a real hub."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import HubServer

from forkd.engine.lazy.chunks import open_remote
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.blobs import FsBlobStore, room
from forkd.store.fetch import ROOM_RESERVE, NoRoom
from forkd.store.packfile import export_pack, import_pack
from forkd.store.store import Store
from forkd.synthetic import write_base

ROOM = 8 << 20  # what the small filesystem has past the reserve
BIG = 16 << 20  # a layer of random pages: its chunks weigh about this much


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with ROOM bytes past ROOM_RESERVE, unmounted after the test."""
    where = tmp_path / "small"
    where.mkdir()
    size = (ROOM_RESERVE + ROOM) >> 10
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k", "tmpfs",
                              str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.fixture
def big(tmp_path: Path) -> Store:
    """A store holding "app:v1", one layer of BIG bytes of random pages."""
    store = Store(tmp_path / "big")
    image = tmp_path / "big.img"
    write_base(image, BIG, seed=3, random_share=1.0)
    store.import_layer("app:v1", memory=image)
    return store


def _chunk_files(store: Store) -> int:
    assert isinstance(store.blobs, FsBlobStore)
    return sum(1 for d in store.blobs.digests() if store.blobs.size(d) > (64 << 10))


def test_a_pack_that_cannot_fit_is_refused_before_its_chunks_are_written(
        small: Path, big: Store, tmp_path: Path) -> None:
    pack = tmp_path / "app.pack"
    export_pack(big, "app:v1", pack)
    store = Store(small / "home")
    free = room(store.blobs)
    assert free is not None and free < ROOM_RESERVE + BIG
    with pytest.raises(NoRoom) as caught:
        import_pack(store, pack)
    said = str(caught.value)
    assert "MiB free" in said and str(store.home) in said and "forkd gc" in said, said
    assert _chunk_files(store) == 0 and store.tags.read() == {}


def test_a_pack_that_fits_is_imported_there(small: Path, tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    image = tmp_path / "small.img"
    write_base(image, 2 << 20, seed=4, random_share=1.0)
    source.import_layer("app:v1", memory=image)
    export_pack(source, "app:v1", tmp_path / "small.pack")
    store = Store(small / "home")
    assert import_pack(store, tmp_path / "small.pack").head == "app:v1"
    assert store.verify() == []


def test_a_pull_and_a_lazy_source_that_cannot_fit_are_refused(
        small: Path, big: Store, tmp_path: Path) -> None:
    hub = HubServer(tmp_path / "hub").start()
    try:
        who = hub.add_user("roomy")
        remote = parse_remote(f"{hub.address}/roomy/app:v1")
        with RegistryClient(hub.target, Credential(*who)) as client:
            push(big, "app:v1", remote, client)
            store = Store(small / "home")
            with pytest.raises(NoRoom, match="MiB free"):
                pull(store, remote, client)
            assert _chunk_files(store) == 0 and store.tags.read() == {}
            with pytest.raises(NoRoom, match="MiB free"):
                open_remote(store, remote, client)
            assert _chunk_files(store) == 0
    finally:
        hub.stop()
