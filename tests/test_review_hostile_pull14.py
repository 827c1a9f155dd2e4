"""Hostile review of the client side (pull round 14): a hub that is an attacker's.

* A pack's config is the pusher's words, but only its texts were checked: its numbers
  (compat.vcpus, compat.memory_mib, compat.agent_protocol, depth, memory_size, ...) could
  be anything JSON holds. A string there was printed raw by ``forkd pull``'s "this host
  cannot fork it" warning and by ``forkd inspect`` (an escape sequence drove the user's
  terminal), ``vcpus`` went into QEMU's ``-smp`` (``"1,maxcpus=..."``: an option of the
  pusher's choosing) and any size into the engine unbounded; a non-text tag made the
  store raise a bare TypeError. A config is now refused unless each field has its type
  and its bounds (SnapshotConfig.validate), before anything is tagged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hostile_hub import HostileHub

from forkd import digest as dg
from forkd.errors import IntegrityError
from forkd.pack import mediatypes as mt
from forkd.pack.chunking import compress
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, ChunkRef, ImageMap
from forkd.pack.manifest import Descriptor, Manifest
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import pull
from forkd.store.store import Store

ESC = "\x1b]0;owned\x07"


def good_config() -> dict[str, Any]:
    return {
        "tag": "evil/cfg:v1", "parent_tag": None, "parent_digest": None, "depth": 0,
        "memory_size": 4 * PAGE_SIZE, "disk_size": None, "page_size": PAGE_SIZE,
        "compat": {"vmm": "qemu", "vmm_version": "8.2.2", "machine": "microvm",
                   "cpu_model": "max", "accelerators": ["tcg"], "vcpus": 1,
                   "memory_mib": 256, "kernel_digest": None, "agent_protocol": 2},
        "created_at": "2026-01-01T00:00:00Z", "description": "", "recipe": None,
        "compacted_from": None, "schema": 1, "extra": {},
    }


def publish(store: Store, config: dict[str, Any]) -> str:
    """A one-layer pack whose config is ``config`` (as given, unchecked); its digest."""
    data = bytes([7]) * (4 * PAGE_SIZE)
    blob = compress(data)
    ref = ChunkRef(dg.of_bytes(blob), dg.blake3_of(data), len(data), len(blob), ((0, 4),))
    raw_map = ImageMap("flat", 4 * PAGE_SIZE, (ref,)).to_bytes()
    raw_config = json.dumps(config).encode()
    manifest = Manifest(
        config=Descriptor(mt.CONFIG, dg.of_bytes(raw_config), len(raw_config)),
        maps={"memory": Descriptor(mt.MEMORY_MAP, dg.of_bytes(raw_map), len(raw_map))},
        chunks=(Descriptor(mt.MEMORY_CHUNK, ref.digest, ref.stored),),
        files={}, subject=None, annotations={},
    ).to_bytes()
    for body in (blob, raw_map, raw_config, manifest):
        store.blobs.put_bytes(body, dg.of_bytes(body))
    return dg.of_bytes(manifest)


HOSTILE_FIELDS: list[tuple[str, Any]] = [
    ("compat.agent_protocol", ESC),
    ("compat.vcpus", "1,maxcpus=4096"),
    ("compat.vcpus", 1 << 20),
    ("compat.vcpus", 0),
    ("compat.vcpus", True),
    ("compat.memory_mib", ESC),
    ("compat.memory_mib", 1 << 60),
    ("compat.memory_mib", 2.5),
    ("compat.accelerators", []),
    ("compat.kernel_digest", ESC),
    ("depth", ESC),
    ("depth", 1 << 40),
    ("memory_size", 8192.0),
    ("memory_size", 1 << 62),
    ("disk_size", ESC),
    ("disk_size", -4096),
    ("tag", 12),
    ("parent_digest", 12),
    ("recipe", ESC),
    ("extra", [ESC]),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE_FIELDS)
def test_a_config_field_of_the_wrong_type_or_out_of_bounds_is_refused_by_pull(
        tmp_path: Path, field: str, value: Any) -> None:
    config = good_config()
    where = config
    *outer, last = field.split(".")
    for key in outer:
        where = where[key]
    where[last] = value
    publisher = Store(tmp_path / "publisher")
    head = publish(publisher, config)
    store = Store(tmp_path / "home")
    with HostileHub(publisher, {"v1": head}) as hub, RegistryClient(hub.hub) as client, \
            pytest.raises(IntegrityError, match=last):
        pull(store, parse_remote(f"{hub.hub.host}/evil/cfg:v1"), client)
    assert store.tags.read() == {}  # nothing tagged


def test_an_honest_config_still_pulls(tmp_path: Path) -> None:
    publisher = Store(tmp_path / "publisher")
    head = publish(publisher, good_config())
    store = Store(tmp_path / "home")
    with HostileHub(publisher, {"v1": head}) as hub, RegistryClient(hub.hub) as client:
        pull(store, parse_remote(f"{hub.hub.host}/evil/cfg:v1"), client)
    assert store.config(head).compat is not None
    assert SnapshotConfig.from_bytes(json.dumps(good_config()).encode()).depth == 0

