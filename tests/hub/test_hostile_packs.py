"""A public pack whose config nests 100 000 levels deep (issue 10 item 11): the filtered
search (which parses every head's config) used to raise RecursionError, a 500 for every
visitor. It now skips the unreadable pack and lists the good ones."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hub_support import HubServer, push_blob

from forkd.pack import mediatypes as mt
from forkd.pack.config import Compat
from forkd.store.store import Store
from forkd.synthetic import write_base

DEEP = 100_000


def _deep_pack(hub: HubServer, who: tuple[str, str], repo: str, tag: str) -> None:
    """Push a forkd-typed manifest whose config blob is ``[[[…]]]``, 100 000 deep."""
    config = b"[" * DEEP + b"]" * DEEP
    imap = json.dumps(
        {"version": 1, "kind": "flat", "size": 4096, "page_size": 4096, "chunks": [], "zero": []}
    ).encode()
    with hub.client(who) as c:
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": mt.OCI_MANIFEST,
                "artifactType": mt.ARTIFACT_TYPE,
                "config": {
                    "mediaType": mt.CONFIG,
                    "digest": push_blob(c, repo, config),
                    "size": len(config),
                },
                "layers": [
                    {
                        "mediaType": mt.MEMORY_MAP,
                        "digest": push_blob(c, repo, imap),
                        "size": len(imap),
                    }
                ],
            }
        ).encode()
        r = c.put(
            f"/v2/{repo}/manifests/{tag}",
            content=manifest,
            headers={"Content-Type": mt.OCI_MANIFEST},
        )
        assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, str, str]]:
    """A hub with a good public qemu pack (kvm and tcg) and a public deeply nested one."""
    root = tmp_path_factory.mktemp("hostile-packs")
    server = HubServer(root / "hub").start()
    try:
        owner = server.add_user("deepowner")
        store = Store.open(root / "store")
        image = root / "base.mem"
        write_base(image, 1 << 20, seed=3)
        qemu = Compat("qemu", "8.2.2", "pc-q35-8.2", "max", ["kvm", "tcg"], 1, 1, None, 1)
        store.import_layer("good", memory=image, compat=qemu)
        good, deep = "deepowner/goodbox", "deepowner/deepbox"
        server.push(store, "good", f"{good}:v1", owner)
        _deep_pack(server, owner, deep, "v1")
        server.public(good)
        server.public(deep)
        yield server, good, deep
    finally:
        server.stop()


@pytest.mark.parametrize("query", ["vmm=qemu", "nokvm=1", "vmm=qemu&nokvm=1", "vmm=firecracker"])
def test_filtered_search_skips_an_unparsable_config(
    packs: tuple[HubServer, str, str], query: str
) -> None:
    hub, good, deep = packs
    with hub.client() as anonymous:
        r = anonymous.get(f"/-/search?{query}")
    assert r.status_code == 200, r.text[-2000:]
    assert (good in r.text) == (query != "vmm=firecracker")
    assert deep not in r.text


def test_unfiltered_search_and_pages_of_the_deep_pack_answer(
    packs: tuple[HubServer, str, str],
) -> None:
    hub, good, deep = packs
    with hub.client() as anonymous:
        r = anonymous.get("/-/search")
        assert r.status_code == 200, r.text[-2000:]
        assert good in r.text and deep in r.text
        for path in (f"/{deep}", f"/{deep}/tags/v1", f"/api/v1/repositories/{deep}"):
            assert anonymous.get(path).status_code < 500, path


def test_a_deeply_nested_manifest_push_is_400(packs: tuple[HubServer, str, str]) -> None:
    hub, good, _ = packs
    body = b'{"schemaVersion": 2, "annotations": {"x": ' + b"[" * DEEP + b"]" * DEEP + b"}}"
    with hub.client(("deepowner", "deepowner-password-1")) as c:
        r = c.put(
            f"/v2/{good}/manifests/deep", content=body, headers={"Content-Type": mt.OCI_MANIFEST}
        )
    assert r.status_code == 400, r.text[-2000:]
    assert f"nests {DEEP + 2} levels deep" in r.text


@pytest.mark.parametrize("stored", [None, "", "[" * DEEP + "]" * DEEP, '["x"]', "not json", "7"])
def test_unreadable_stored_annotations_read_as_none(stored: str | None) -> None:
    from forkd.hub.catalog import annotations_of

    assert annotations_of(stored) == {}
    assert annotations_of('{"a": "b"}') == {"a": "b"}
