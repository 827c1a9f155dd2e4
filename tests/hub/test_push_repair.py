"""`forkd push` pushes a blob again when the hub answers MANIFEST_BLOB_UNKNOWN (the blob
was unlinked, or garbage-collected, between the client's HEAD and its manifest PUT), and
retries the manifest once (issue 10 item 13d)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hub_support import HubServer

from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.credentials import Credential
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import push
from forkd.store.store import Store


def _unlink_before_manifest_put(
    hub: HubServer,
    who: tuple[str, str],
    repo: str,
    client: RegistryClient,
    times: int,
    retries_too: bool = False,
) -> list[str]:
    """Before each of the first ``times`` manifest PUTs (first PUTs of each manifest,
    unless ``retries_too``), delete the link of that manifest's last layer blob from the
    repository, as another client could; return the digests unlinked."""
    unlinked: list[str] = []
    put: set[str] = set()

    def hook(request: httpx.Request) -> None:
        if request.method != "PUT" or "/manifests/" not in request.url.path:
            return
        again = request.url.path in put
        put.add(request.url.path)
        if len(unlinked) >= times or (again and not retries_too):
            return
        doc = json.loads(request.content)
        victim = doc["layers"][-1]["digest"] if doc.get("layers") else doc["config"]["digest"]
        with hub.client(who) as other:
            r = other.delete(f"/v2/{repo}/blobs/{victim}")
            assert r.status_code == 202, r.text
        unlinked.append(victim)

    client.http.event_hooks["request"].append(hook)
    return unlinked


def test_push_pushes_an_unlinked_blob_again(
    hub: HubServer, user: tuple[str, str], store: Store, chain: list[str], tmp_path: Path
) -> None:
    repo = f"{user[0]}/repair"
    remote = parse_remote(f"{hub.address}/{repo}:v1")
    with RegistryClient(hub.target, Credential(*user)) as client:
        unlinked = _unlink_before_manifest_put(hub, user, repo, client, times=len(chain))
        result = push(store, "d3", remote, client)
    assert len(unlinked) == len(chain)  # every manifest PUT met a missing blob first
    assert result.digest == store.resolve("d3")
    with hub.client(user) as c:
        for digest in unlinked:
            assert c.head(f"/v2/{repo}/blobs/{digest}").status_code == 200
    # The pushed chain is whole: it pulls into a fresh store.
    from forkd.registry.transfer import pull

    with RegistryClient(hub.target, Credential(*user)) as client:
        assert pull(Store(tmp_path / "other"), remote, client).digest == store.resolve("d3")


def test_push_retries_a_manifest_only_once(
    hub: HubServer, user: tuple[str, str], store: Store, chain: list[str]
) -> None:
    """A blob that keeps vanishing is not chased forever: the second refusal stands."""
    repo = f"{user[0]}/vanishing"
    remote = parse_remote(f"{hub.address}/{repo}:v1")
    with RegistryClient(hub.target, Credential(*user)) as client:
        unlinked = _unlink_before_manifest_put(hub, user, repo, client, times=2, retries_too=True)
        with pytest.raises(RegistryError, match="MANIFEST_BLOB_UNKNOWN"):
            push(store, "base", remote, client)
    assert len(unlinked) == 2
