"""Hostile review of the pull side (round 1), store only: what a pulled pack costs the
host when it is used, against a real hub and a real small filesystem (a tmpfs).

* A pull is refused when the chain's blobs cannot fit (check_room), but assembling the
  pulled chain wrote whatever its maps declare: 2 MiB of one repeated byte is stored in a
  few dozen bytes, so a pack of a few KB made ``forkd fork`` write up to a TiB into the
  store's cache, filling the disk the host's VMs and store live on. Assembly now refuses
  an image whose written bytes cannot fit (NoRoom) before it writes one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_hub import HostileHub
from hostile_packs import repeated_memory
from test_store_room import small  # noqa: F401  (the tmpfs fixture)

from forkd.pack.imagemap import CHUNK_SIZE
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import pull
from forkd.store.blobs import room
from forkd.store.fetch import NoRoom
from forkd.store.store import Store


def test_a_pulled_pack_that_assembles_past_the_free_space_is_refused_before_writing(
        tmp_path: Path, small: Path) -> None:  # noqa: F811
    count = 48  # 96 MiB of pages, each 2 MiB stored in a few dozen bytes
    publisher = repeated_memory(tmp_path / "publisher", "bomb:v1", count)
    store = Store(small / "home")
    with HostileHub(publisher, {"v1": publisher.resolve("bomb:v1")}) as hub, \
            RegistryClient(hub.hub) as client:
        pull(store, parse_remote(f"{hub.hub.host}/evil/bomb:v1"), client)
    free = room(store.blobs)
    assert free is not None and free < count * CHUNK_SIZE
    with pytest.raises(NoRoom, match="evil/bomb:v1"):
        store.assemble("evil/bomb:v1")
    assert room(store.blobs) == free  # not a byte written
