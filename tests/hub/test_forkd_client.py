"""forkd's own client (forkd.registry) against the hub: a chain of packs, lineage, scopes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_support import HubServer

from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store


def test_push_pull_chain_through_the_hub(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
) -> None:
    target = Hub(hub.address, "http")
    remote = parse_remote(f"{target}/{user[0]}/app:v1")
    with RegistryClient(target, Credential(*user)) as client:
        first = push(store, "d3", remote, client)
        assert first.layers == 4 and first.blobs_sent > 0
        again = push(store, "d3", remote, client)
        assert again.blobs_sent == 0  # only missing blobs travel
        other = Store(tmp_path / "other")
        got = pull(other, remote, client)
        assert got.digest == store.resolve("d3")
        assert other.assemble(f"{user[0]}/app:v1").memory.read_bytes() == images[3].read_bytes()

    # Lineage: each diff layer's manifest names its parent as subject; the referrers API
    # finds the children of every ancestor.
    with hub.client(auth=user) as c:
        head = json.loads(c.get(f"/v2/{user[0]}/app/manifests/v1").content)
        parent = head["subject"]["digest"]
        r = c.get(f"/v2/{user[0]}/app/referrers/{parent}")
        assert [d["digest"] for d in r.json()["manifests"]] == [store.resolve("d3")]

    # Someone without rights can neither push nor see it (404 NAME_UNKNOWN, not 403).
    stranger = hub.add_user(f"{user[0]}z")
    with (
        RegistryClient(target, Credential(*stranger)) as client,
        pytest.raises(RegistryError, match="NAME_UNKNOWN"),
    ):
        push(store, "d1", parse_remote(f"{target}/{user[0]}/app:v2"), client)
