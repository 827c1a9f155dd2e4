"""Manifests, tags and referrers: validation, tag/digest addressing, pagination, lineage."""

from __future__ import annotations

import json

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

OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def test_put_get_head_by_tag_and_digest(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/pack"
    with hub.client(auth=user) as c:
        digest, body = artifact(c, name, b"layer bytes", tag="v1")
        for ref in ("v1", digest):
            r = c.get(f"/v2/{name}/manifests/{ref}")
            assert r.status_code == 200 and r.content == body
            assert r.headers["content-type"] == OCI_MANIFEST
            assert r.headers["docker-content-digest"] == digest
            r = c.head(f"/v2/{name}/manifests/{ref}")
            assert r.status_code == 200 and r.content == b""
            assert r.headers["content-length"] == str(len(body))
        r = c.get(f"/v2/{name}/manifests/v2")
        assert r.status_code == 404 and error_code(r) == "MANIFEST_UNKNOWN"
        r = c.get(f"/v2/{name}/manifests/{sha(b'nope')}")
        assert r.status_code == 404 and error_code(r) == "MANIFEST_UNKNOWN"
        # Re-tagging moves the tag.
        _, body2 = artifact(c, name, b"other layer", tag="v1")
        assert c.get(f"/v2/{name}/manifests/v1").content == body2
        assert c.get(f"/v2/{name}/manifests/{digest}").content == body


def _manifest(layer_digest: str, size: int, **extra: object) -> dict[str, object]:
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
        "layers": [{"mediaType": "application/octet-stream", "digest": layer_digest, "size": size}],
        **extra,
    }


def test_invalid_manifests_are_refused(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/invalid"
    with hub.client(auth=user) as c:
        push_blob(c, name, EMPTY_CONFIG)
        layer = push_blob(c, name, b"abc")

        def put(body: bytes, ref: str = "t", content_type: str = OCI_MANIFEST) -> tuple[int, str]:
            r = c.put(
                f"/v2/{name}/manifests/{ref}", content=body, headers={"Content-Type": content_type}
            )
            return r.status_code, error_code(r) if r.status_code >= 400 else ""

        ok = json.dumps(_manifest(layer, 3)).encode()
        assert put(b"{not json") == (400, "MANIFEST_INVALID")
        assert put(b"[]") == (400, "MANIFEST_INVALID")
        assert put(ok, content_type="text/plain") == (400, "MANIFEST_INVALID")
        assert put(ok, content_type=OCI_INDEX) == (400, "MANIFEST_INVALID")  # mediaType differs
        bad_version = json.dumps(_manifest(layer, 3, schemaVersion=1)).encode()
        assert put(bad_version) == (400, "MANIFEST_INVALID")
        bad_digest = json.dumps(_manifest("sha256:1234", 3)).encode()
        assert put(bad_digest) == (400, "MANIFEST_INVALID")
        bad_size = json.dumps(_manifest(layer, 4)).encode()
        assert put(bad_size) == (400, "MANIFEST_INVALID")
        missing = json.dumps(_manifest(sha(b"not pushed"), 10)).encode()
        assert put(missing) == (400, "MANIFEST_BLOB_UNKNOWN")
        hexd = sha(missing).split(":")[1]
        assert not (hub.data_dir / "blobs" / "sha256" / hexd[:2] / hexd).exists()
        assert put(ok, ref="bad..tag!") == (400, "MANIFEST_INVALID")
        assert put(ok, ref=sha(b"something else")) == (400, "DIGEST_INVALID")
        big = json.dumps(_manifest(layer, 3, annotations={"x": "y" * (4 << 20)})).encode()
        assert put(big) == (413, "SIZE_INVALID")
        assert put(ok, ref=sha(ok)) == (201, "")
        r = c.get(f"/v2/{name}/tags/list")
        assert r.json()["tags"] == []  # nothing refused became a tag


def test_index_needs_its_manifests(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/index"
    with hub.client(auth=user) as c:
        digest, body = artifact(c, name, b"child")
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [{"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body)}],
        }
        r = c.put(f"/v2/{name}/manifests/all", json=index, headers={"Content-Type": OCI_INDEX})
        assert r.status_code == 201, r.text
        index["manifests"][0]["digest"] = sha(b"unknown")  # type: ignore[index]
        r = c.put(f"/v2/{name}/manifests/bad", json=index, headers={"Content-Type": OCI_INDEX})
        assert r.status_code == 400 and error_code(r) == "MANIFEST_BLOB_UNKNOWN"


def test_delete_tag_and_manifest(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/del"
    with hub.client(auth=user) as c:
        digest, _ = artifact(c, name, b"to delete", tag="a")
        c.put(
            f"/v2/{name}/manifests/b",
            content=c.get(f"/v2/{name}/manifests/a").content,
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert c.delete(f"/v2/{name}/manifests/a").status_code == 202
        assert c.get(f"/v2/{name}/manifests/a").status_code == 404
        assert c.get(f"/v2/{name}/manifests/{digest}").status_code == 200
        assert c.delete(f"/v2/{name}/manifests/a").status_code == 404
        assert c.delete(f"/v2/{name}/manifests/{digest}").status_code == 202
        assert c.get(f"/v2/{name}/manifests/b").status_code == 404  # its tags went with it
        assert c.get(f"/v2/{name}/manifests/{digest}").status_code == 404
        assert c.delete(f"/v2/{name}/manifests/{digest}").status_code == 404


def test_tags_list_pagination(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/tags"
    with hub.client(auth=user) as c:
        _, body = artifact(c, name, b"tagged", tag="t0")
        tags = ["t0", "t1", "t2", "t3", "t4"]
        for tag in tags[1:]:
            r = c.put(
                f"/v2/{name}/manifests/{tag}", content=body, headers={"Content-Type": OCI_MANIFEST}
            )
            assert r.status_code == 201
        r = c.get(f"/v2/{name}/tags/list")
        assert r.json() == {"name": name, "tags": tags} and "link" not in r.headers
        seen: list[str] = []
        url = f"/v2/{name}/tags/list?n=2"
        while url:
            r = c.get(url)
            assert r.status_code == 200
            seen += r.json()["tags"]
            link = r.headers.get("link", "")
            url = link[1 : link.index(">")] if link else ""
            assert not link or link.endswith('rel="next"')
        assert seen == tags
        assert c.get(f"/v2/{name}/tags/list", params={"n": 2, "last": "t1"}).json()["tags"] == [
            "t2",
            "t3",
        ]
        assert c.get(f"/v2/{name}/tags/list", params={"n": 0}).json()["tags"] == []
        assert c.get(f"/v2/{name}/tags/list", params={"n": "-1"}).status_code == 400
        r = c.get(f"/v2/{user[0]}/nope/tags/list")
        assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN"


def test_subject_and_referrers(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/chain"
    with hub.client(auth=user) as c:
        base, base_body = artifact(c, name, b"base layer", tag="base")
        subject = {"mediaType": OCI_MANIFEST, "digest": base, "size": len(base_body)}
        push_blob(c, name, EMPTY_CONFIG)
        layer = push_blob(c, name, b"diff layer")
        child = _manifest(
            layer,
            len(b"diff layer"),
            artifactType="application/vnd.forkd.snapshot.v1",
            subject=subject,
            annotations={"dev.forkd.parent.tag": "base"},
        )
        body = json.dumps(child).encode()
        r = c.put(
            f"/v2/{name}/manifests/diff", content=body, headers={"Content-Type": OCI_MANIFEST}
        )
        assert r.status_code == 201 and r.headers["oci-subject"] == base
        sig, _ = artifact(c, name, b"signature", artifact_type="application/x.sig", subject=subject)

        r = c.get(f"/v2/{name}/referrers/{base}")
        assert r.status_code == 200 and r.headers["content-type"] == OCI_INDEX
        index = r.json()
        assert index["schemaVersion"] == 2 and index["mediaType"] == OCI_INDEX
        by_digest = {d["digest"]: d for d in index["manifests"]}
        assert set(by_digest) == {sha(body), sig}
        assert by_digest[sha(body)]["artifactType"] == "application/vnd.forkd.snapshot.v1"
        assert by_digest[sha(body)]["annotations"] == {"dev.forkd.parent.tag": "base"}
        assert by_digest[sha(body)]["size"] == len(body)

        r = c.get(f"/v2/{name}/referrers/{base}", params={"artifactType": "application/x.sig"})
        assert [d["digest"] for d in r.json()["manifests"]] == [sig]
        assert r.headers["oci-filters-applied"] == "artifactType"
        r = c.get(f"/v2/{name}/referrers/{sha(b'no such subject')}")
        assert r.status_code == 200 and r.json()["manifests"] == []
        assert c.get(f"/v2/{name}/referrers/sha256:bad").status_code == 400

        # A snapshot chain depends on the base: it cannot be deleted before its children
        # (405, one of the answers the spec allows a DELETE: 202, 404, 405).
        r = c.delete(f"/v2/{name}/manifests/{base}")
        assert r.status_code == 405 and error_code(r) == "UNSUPPORTED"
        assert sha(body) in r.json()["errors"][0]["detail"]  # names the dependent
        assert c.delete(f"/v2/{name}/manifests/base").status_code == 202  # untagging is fine
        assert c.delete(f"/v2/{name}/manifests/{sha(body)}").status_code == 202
        assert c.delete(f"/v2/{name}/manifests/{sig}").status_code == 202
        assert c.delete(f"/v2/{name}/manifests/{base}").status_code == 202
