"""Manifest PUT/DELETE and referrers against the OCI distribution and image specs (issue 10
items 6, 11, 12, 15, 18, 19): what is refused, what each answer is, and what a huge
manifest costs the database."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_support import (
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    artifact,
    error_code,
    push_blob,
    sha,
)
from sqlalchemy import Engine, create_engine, event, insert, select

from forkd.hub.db import Database
from forkd.hub.errors import RegistryError
from forkd.hub.models import Blob, Repository, RepositoryBlob
from forkd.hub.oci.common import IN_CHUNK, database_contention
from forkd.hub.settings import HubSettings

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
CONFIG = {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": len(EMPTY_CONFIG)}


def _put(
    c: httpx.Client, name: str, doc: dict[str, Any] | bytes, ref: str, content_type: str
) -> httpx.Response:
    body = doc if isinstance(doc, bytes) else json.dumps(doc, separators=(",", ":")).encode()
    return c.put(
        f"/v2/{name}/manifests/{ref}", content=body, headers={"Content-Type": content_type}
    )


def _refused(r: httpx.Response, code: str) -> str:
    assert r.status_code == 400 and error_code(r) == code, r.text
    return str(r.json()["errors"][0]["detail"])


def _image(*layers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": CONFIG,
        "layers": [*layers],
    } | extra


def _layer(data: bytes, media_type: str = "application/octet-stream") -> dict[str, Any]:
    return {"mediaType": media_type, "digest": sha(data), "size": len(data)}


# -- item 11: nesting ------------------------------------------------------------------
def test_deeply_nested_manifest_is_manifest_invalid(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/deep"
    with hub.client(auth=user) as c:
        push_blob(c, name, EMPTY_CONFIG)
        flat = json.dumps(_image()).encode()
        for depth in (65, 100_000):  # one past the limit; far past Python's recursion limit
            nested = b"[" * depth + b"]" * depth
            body = flat[:-1] + b',"x":' + nested + b"}"
            detail = _refused(_put(c, name, body, "t", OCI_MANIFEST), "MANIFEST_INVALID")
            assert "nests" in detail
        assert _put(c, name, flat, "t", OCI_MANIFEST).status_code == 201
        assert c.get(f"/v2/{name}/tags/list").json()["tags"] == ["t"]


# -- item 12: ambiguous documents (CVE-2021-41190) -----------------------------------------
def test_ambiguous_documents_are_refused(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/ambiguous"
    with hub.client(auth=user) as c:
        child, child_body = artifact(c, name, b"child")
        entry = {"mediaType": OCI_MANIFEST, "digest": child, "size": len(child_body)}
        layer = _layer(b"child")
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}
        image = _image(layer)

        # An image manifest that also lists manifests, an index that carries layers/config.
        detail = _refused(
            _put(c, name, image | {"manifests": [entry]}, "a", OCI_MANIFEST), "MANIFEST_INVALID"
        )
        assert "manifests" in detail and "ambiguous" in detail
        detail = _refused(
            _put(c, name, index | {"layers": [layer]}, "b", OCI_INDEX), "MANIFEST_INVALID"
        )
        assert "layers" in detail
        _refused(_put(c, name, index | {"config": CONFIG}, "c", OCI_INDEX), "MANIFEST_INVALID")
        _refused(_put(c, name, image | {"manifests": []}, "d", OCI_MANIFEST), "MANIFEST_INVALID")
        # Without mediaType the Content-Type decides, and the fields must not contradict it.
        bare_image = {k: v for k, v in image.items() if k != "mediaType"}
        bare_index = {k: v for k, v in index.items() if k != "mediaType"}
        _refused(
            _put(c, name, bare_image | {"manifests": [entry]}, "e", OCI_MANIFEST),
            "MANIFEST_INVALID",
        )
        _refused(
            _put(c, name, bare_index | {"layers": [layer]}, "f", OCI_INDEX), "MANIFEST_INVALID"
        )
        _refused(_put(c, name, bare_image, "g", OCI_INDEX), "MANIFEST_INVALID")  # no manifests
        # mediaType disagreeing with Content-Type, either way, and not a string.
        _refused(_put(c, name, image, "h", OCI_INDEX), "MANIFEST_INVALID")
        _refused(_put(c, name, index, "i", OCI_MANIFEST), "MANIFEST_INVALID")
        _refused(_put(c, name, image | {"mediaType": 7}, "j", OCI_MANIFEST), "MANIFEST_INVALID")
        # Docker's schema 2 formats require their mediaType field.
        _refused(_put(c, name, bare_image, "k", DOCKER_MANIFEST), "MANIFEST_INVALID")
        _refused(_put(c, name, bare_index, "l", DOCKER_LIST), "MANIFEST_INVALID")
        assert c.get(f"/v2/{name}/tags/list").json()["tags"] == []  # nothing refused was kept

        # Unambiguous documents are accepted: OCI with or without mediaType, Docker with it.
        assert _put(c, name, bare_image, "ok1", OCI_MANIFEST).status_code == 201
        assert _put(c, name, bare_index, "ok2", OCI_INDEX).status_code == 201
        docker = image | {"mediaType": DOCKER_MANIFEST}
        assert _put(c, name, docker, "ok3", DOCKER_MANIFEST).status_code == 201
        docker_list = index | {"mediaType": DOCKER_LIST}
        assert _put(c, name, docker_list, "ok4", DOCKER_LIST).status_code == 201


# -- item 18: non-distributable layers ---------------------------------------------------
NON_DISTRIBUTABLE = [
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
]


@pytest.mark.parametrize("media_type", NON_DISTRIBUTABLE)
def test_non_distributable_layers_need_their_blobs(
    hub: HubServer, user: tuple[str, str], media_type: str
) -> None:
    name = f"{user[0]}/foreign"
    data = f"restricted layer {media_type}".encode()
    layer = _layer(data, media_type) | {"urls": ["https://example.com/layer.tar"]}
    content_type = DOCKER_MANIFEST if "docker" in media_type else OCI_MANIFEST
    doc = _image(layer, mediaType=content_type)
    with hub.client(auth=user) as c:
        push_blob(c, name, EMPTY_CONFIG)
        # urls never stand in for the content: without the blob, MANIFEST_BLOB_UNKNOWN.
        detail = _refused(_put(c, name, doc, "v1", content_type), "MANIFEST_BLOB_UNKNOWN")
        assert layer["digest"] in detail
        bad_urls = _image(layer | {"urls": "https://example.com"}, mediaType=content_type)
        _refused(_put(c, name, bad_urls, "v1", content_type), "MANIFEST_INVALID")
        push_blob(c, name, data)
        assert _put(c, name, doc, "v1", content_type).status_code == 201
        r = c.get(f"/v2/{name}/blobs/{layer['digest']}")
        assert r.status_code == 200 and r.content == data  # served by the hub, not the URL


# -- item 15: DELETE answers only 202, 404 or 405 -----------------------------------------
def test_delete_a_subject_per_the_spec(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/subjects"
    with hub.client(auth=user) as c:
        # A signature on an image: the image may go (202); the signature stays, dangling.
        image, image_body = artifact(c, name, b"image", artifact_type="application/x.image")
        on_image = {"mediaType": OCI_MANIFEST, "digest": image, "size": len(image_body)}
        sig, _ = artifact(c, name, b"sig", artifact_type="application/x.sig", subject=on_image)
        assert c.delete(f"/v2/{name}/manifests/{image}").status_code == 202
        assert c.get(f"/v2/{name}/manifests/{image}").status_code == 404
        r = c.get(f"/v2/{name}/referrers/{image}")
        assert [d["digest"] for d in r.json()["manifests"]] == [sig]
        # A forkd snapshot built on a non-snapshot: the subject may go too.
        other, other_body = artifact(c, name, b"other", artifact_type="application/x.image")
        on_other = {"mediaType": OCI_MANIFEST, "digest": other, "size": len(other_body)}
        artifact(c, name, b"snap on image", subject=on_other)
        assert c.delete(f"/v2/{name}/manifests/{other}").status_code == 202

        # A forkd snapshot other forkd snapshots build on: 405, naming them.
        base, base_body = artifact(c, name, b"base", tag="base")
        on_base = {"mediaType": OCI_MANIFEST, "digest": base, "size": len(base_body)}
        sbom, _ = artifact(c, name, b"sbom", artifact_type="application/spdx+json", subject=on_base)
        children = [artifact(c, name, b"diff %d" % i, subject=on_base)[0] for i in range(7)]
        r = c.delete(f"/v2/{name}/manifests/{base}")
        assert r.status_code == 405 and error_code(r) == "UNSUPPORTED"
        assert r.headers["allow"] == "GET, HEAD, PUT"
        detail = r.json()["errors"][0]["detail"]
        assert "7 forkd snapshot(s)" in detail and "and 2 more" in detail
        assert sum(child in detail for child in children) == 5 and sbom not in detail
        assert c.get(f"/v2/{name}/manifests/base").status_code == 200  # nothing changed
        for child in children:
            assert c.delete(f"/v2/{name}/manifests/{child}").status_code == 202
        assert c.delete(f"/v2/{name}/manifests/{base}").status_code == 202  # the SBOM stays
        r = c.get(f"/v2/{name}/referrers/{base}")
        assert [d["digest"] for d in r.json()["manifests"]] == [sbom]
        assert c.delete(f"/v2/{name}/manifests/{base}").status_code == 404


# -- item 19: referrers never 404 for a repository the caller may pull --------------------
def test_referrers_of_a_repository_not_pushed_yet(hub: HubServer, user: tuple[str, str]) -> None:
    subject = sha(b"anything")
    with hub.client(auth=user) as c:
        for query in ({}, {"artifactType": "application/x.sig"}):
            r = c.get(f"/v2/{user[0]}/nothing-yet/referrers/{subject}", params=query)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == OCI_INDEX
            assert r.json() == {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        r = c.get(f"/v2/{user[0]}/nothing-yet/referrers/sha256:bad")
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        # Someone else's namespace stays invisible.
        other = hub.add_user(f"{user[0]}-other")
        r = c.get(f"/v2/{other[0]}/nothing-yet/referrers/{subject}")
        assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN"
    with hub.client() as anonymous:
        r = anonymous.get(f"/v2/{user[0]}/nothing-yet/referrers/{subject}")
        assert r.status_code == 401


# -- item 6: a huge manifest is cheap for the database -------------------------------------
@contextmanager
def _statements() -> Iterator[list[str]]:
    """Every SQL statement any engine of this process sends (the hub runs in-process)."""
    seen: list[str] = []

    def on_execute(*args: Any) -> None:
        seen.append(args[2])

    event.listen(Engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", on_execute)


def _link_directly(server: HubServer, name: str, blobs: list[tuple[str, int]]) -> None:
    """Record blobs as linked into ``name`` straight in the hub's database: pushing 30,000
    blobs through the API takes minutes, and the manifest PUT only reads these rows."""

    async def go() -> None:
        db = Database(HubSettings(server.data_dir, **server.overrides).validated().database_url)
        try:
            async with db.transaction() as session:
                repo_id = await session.scalar(select(Repository.id).where(Repository.name == name))
                await session.execute(insert(Blob), [{"digest": d, "size": n} for d, n in blobs])
                await session.execute(
                    insert(RepositoryBlob),
                    [{"repository_id": repo_id, "digest": d} for d, _ in blobs],
                )
        finally:
            await db.close()

    asyncio.run(go())


LAYERS = 30_000


def test_a_30000_layer_manifest_is_checked_set_based(backend_hub: HubServer) -> None:
    user = backend_hub.add_user("bulk")
    other = backend_hub.add_user("neighbour")
    name = "bulk/app"
    layers = [_layer(b"%d" % i) for i in range(LAYERS)]
    with backend_hub.client(auth=user) as c:
        push_blob(c, name, EMPTY_CONFIG)  # creates the repository
        _link_directly(backend_hub, name, [(d["digest"], d["size"]) for d in layers])
        body = json.dumps(_image(*layers), separators=(",", ":")).encode()
        assert len(body) < 4 << 20  # within the default manifest_max_bytes

        with _statements() as seen:
            r = _put(c, name, body, "big", OCI_MANIFEST)
        assert r.status_code == 201, r.text
        # One query per layer (and an insert per reference) was 60,000 statements; now a
        # query per IN_CHUNK digests to check, a count per chunk to confirm, a handful more.
        chunks = -(-LAYERS // IN_CHUNK)
        assert len(seen) < 2 * chunks + 100, len(seen)
        doc = json.loads(c.get(f"/v2/{name}/manifests/big").content)
        assert len(doc["layers"]) == LAYERS

        # One layer gone: the refusal names it, and nothing is recorded.
        missing = _layer(b"never linked")
        with_missing = _image(*layers[:-1], missing)
        detail = _refused(
            _put(c, name, with_missing, "broken", OCI_MANIFEST), "MANIFEST_BLOB_UNKNOWN"
        )
        assert missing["digest"] in detail
        wrong_size = _image(*layers[:-1], layers[-1] | {"size": 999})
        _refused(_put(c, name, wrong_size, "broken", OCI_MANIFEST), "MANIFEST_INVALID")
        assert c.get(f"/v2/{name}/tags/list").json()["tags"] == ["big"]

        # Other users' small pushes while big manifests are pushed: never a 500.
        statuses: list[int] = []
        done = threading.Event()

        def big_pushes() -> None:
            with backend_hub.client(auth=user) as big:
                for i in range(2):
                    statuses.append(_put(big, name, body, f"big{i}", OCI_MANIFEST).status_code)
            done.set()

        pusher = threading.Thread(target=big_pushes)
        pusher.start()
        small: list[int] = []
        with backend_hub.client(auth=other) as s:
            i = 0
            while not done.is_set() or not small:
                push_blob(s, "neighbour/small", EMPTY_CONFIG)
                layer = push_blob(s, "neighbour/small", b"small %d" % i)
                doc = _image(
                    {
                        "mediaType": "application/octet-stream",
                        "digest": layer,
                        "size": len(b"small %d" % i),
                    }
                )
                small.append(_put(s, "neighbour/small", doc, f"t{i}", OCI_MANIFEST).status_code)
                i += 1
        pusher.join()
        assert statuses == [201, 201]
        assert set(small) == {201}


# -- contention: a lock timeout is 503 + Retry-After, never a 500 -----------------------
def test_a_lock_timeout_becomes_503_with_retry_after(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    try:
        with (
            pytest.raises(RegistryError) as refused,
            database_contention(),
            engine.begin() as conn,
        ):
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        assert refused.value.status == 503
        assert refused.value.headers["Retry-After"].isdigit()
        assert refused.value.code.name == "TOOMANYREQUESTS"
        # Anything else still propagates as what it is.
        holder.execute("ROLLBACK")
        with (
            pytest.raises(Exception, match="no such table"),
            database_contention(),
            engine.begin() as conn,
        ):
            conn.exec_driver_sql("INSERT INTO missing VALUES (1)")
    finally:
        engine.dispose()
        holder.close()
