"""sha512 digests (forkd issue 10, item 17): the hub takes blobs and manifests addressed by
sha512 wherever the OCI Distribution spec lets a client choose the algorithm; forkd's own
packs and local store stay sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hub_support import EMPTY_CONFIG, EMPTY_MEDIA, OCI_MANIFEST, HubServer, error_code, sha
from s3_hub_support import PREFIX, S3Hub
from s3_support import MOTO_CREDENTIALS, MotoServer

from forkd import digest as dg
from forkd.cli.hub_cmds import hub as hub_group
from forkd.errors import IntegrityError, InvalidInput
from forkd.pack.manifest import Descriptor
from forkd.store.blobs import FsBlobStore
from forkd.store.s3 import MIN_PART_SIZE, S3BlobStore

MiB = 1 << 20


def sha512(data: bytes) -> str:
    return dg.of_bytes(data, "sha512")


def push512(c: httpx.Client, repo: str, data: bytes) -> str:
    digest = sha512(data)
    r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": digest}, content=data)
    assert r.status_code == 201, r.text
    assert r.headers["docker-content-digest"] == digest
    assert r.headers["location"] == f"/v2/{repo}/blobs/{digest}"
    return digest


def push_chunked(c: httpx.Client, repo: str, data: bytes, digest: str, step: int) -> httpx.Response:
    """POST, PATCH in ``step``-byte chunks but the last, which comes with the closing PUT."""
    location = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
    offset = 0
    while len(data) - offset > step:
        chunk = data[offset : offset + step]
        r = c.patch(
            location,
            content=chunk,
            headers={"Content-Range": f"{offset}-{offset + len(chunk) - 1}"},
        )
        assert r.status_code == 202, r.text
        location, offset = r.headers["location"], offset + len(chunk)
    last = data[offset:]
    return c.put(
        location,
        params={"digest": digest},
        content=last,
        headers={"Content-Range": f"{offset}-{offset + len(last) - 1}"},
    )


def manifest_of(config: str, layer: str, layer_size: int, **extra: Any) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.sha512",
        "config": {"mediaType": EMPTY_MEDIA, "digest": config, "size": len(EMPTY_CONFIG)},
        "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": layer_size}],
        **extra,
    }
    return json.dumps(doc).encode()


def put_manifest(c: httpx.Client, repo: str, reference: str, body: bytes) -> httpx.Response:
    return c.put(
        f"/v2/{repo}/manifests/{reference}", content=body, headers={"Content-Type": OCI_MANIFEST}
    )


# -- the digest module and the stores --------------------------------------------------------


def test_digest_parser_by_algorithm() -> None:
    long = sha512(b"x")
    assert dg.parse(long) == ("sha512", long.split(":", 1)[1]) and len(long) == 7 + 128
    assert dg.parse(dg.of_bytes(b"x")) == ("sha256", dg.of_bytes(b"x").split(":", 1)[1])
    assert long == "sha512:" + hashlib.sha512(b"x").hexdigest()
    hexd = long.split(":", 1)[1]
    for bad in [
        "sha512:" + hexd[:-1],  # 127 hex
        "sha512:" + hexd + "0",  # 129 hex
        "sha512:" + hexd.upper(),
        "sha512:" + dg.of_bytes(b"x").split(":", 1)[1],  # a sha256's length
        "sha256:" + hexd,  # a sha512's length
        "SHA512:" + hexd,
        "sha384:" + "0" * 96,
        long + "\n",
        " " + long,
        "sha512:" + hexd[:-1] + "\u0661",  # a non-ASCII digit
    ]:
        with pytest.raises(InvalidInput):
            dg.parse(bad)
    # forkd's own digests (packs, the local store's manifests) stay sha256 only.
    with pytest.raises(InvalidInput, match="sha256"):
        dg.validate(long)
    with pytest.raises(InvalidInput):
        dg.hex_part(long)
    with pytest.raises(InvalidInput):
        Descriptor.from_json({"mediaType": "x", "digest": long, "size": 1}, "layer")
    with pytest.raises(InvalidInput, match="unsupported digest algorithm"):
        dg.of_bytes(b"x", "md5")


def test_fs_store_keeps_sha256_paths_and_lays_out_sha512(tmp_path: Path) -> None:
    store = FsBlobStore(tmp_path / "blobs")
    short, long = store.put_bytes(b"old"), store.put_bytes(b"new", sha512(b"new"))
    assert store.path(short) == tmp_path / "blobs" / "sha256" / short[7:9] / short[7:]
    assert store.path(long) == tmp_path / "blobs" / "sha512" / long[7:9] / long[7:]
    assert store.read(long, 3) == b"new" and store.size(long) == 3
    assert sorted(store.digests()) == sorted([short, long])  # what gc lists
    (tmp_path / "blobs" / "sha512" / "zz").mkdir()
    (tmp_path / "blobs" / "sha512" / "zz" / "not-a-digest").write_bytes(b"stray")
    assert sorted(store.digests()) == sorted([short, long])
    with pytest.raises(IntegrityError, match="digest mismatch"):  # verified by sha512
        store.put_bytes(b"other", sha512(b"new!"))
    with pytest.raises(IntegrityError, match="truncated"):
        store.put_stream([b"ne"], sha512(b"new2"), 4)
    store.path(long).chmod(0o644)
    store.path(long).write_bytes(b"bad")
    with pytest.raises(IntegrityError, match="digest mismatch"):  # read checks by sha512
        store.read(long, 3)
    assert list(store.tmp.iterdir()) == []


def test_s3_store_keys_by_algorithm(moto_server: MotoServer) -> None:
    client, bucket = moto_server.client(), moto_server.new_bucket()
    store = S3BlobStore(client, bucket, "team/hub", part_size=MIN_PART_SIZE)
    short = store.put_bytes(b"old")
    data = bytes(range(256)) * (48 * 1024)  # 12 MiB: a multipart upload to the final key
    long = store.put_stream(iter([data[: 6 * MiB], data[6 * MiB :]]), sha512(data), len(data))
    assert store.key(short) == f"team/hub/blobs/sha256/{short[7:]}"  # unchanged
    assert store.key(long) == f"team/hub/blobs/sha512/{long[7:]}"
    assert store.read(long, len(data)) == data
    client.put_object(Bucket=bucket, Key="team/hub/blobs/sha512/not-a-digest", Body=b"x")
    client.put_object(Bucket=bucket, Key="team/hub/blobs/stray", Body=b"x")
    assert sorted(store.digests()) == sorted([short, long])
    with pytest.raises(IntegrityError, match="digest mismatch"):
        store.put_stream(iter([data]), sha512(data + b"!"), len(data))
    assert not store.has(sha512(data + b"!"))
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# -- the registry API ------------------------------------------------------------------------


def test_sha512_blob_push_head_get_mount_delete(backend_hub: HubServer) -> None:
    """On SQLite and PostgreSQL (which, unlike SQLite, enforces the digest columns' width)."""
    user = backend_hub.add_user("blob512")
    repo, other = f"{user[0]}/app", f"{user[0]}/other"
    data = b"a layer addressed by sha512" * 1000
    with backend_hub.client(auth=user) as c:
        digest = push512(c, repo, data)  # monolithic POST
        r = c.head(f"/v2/{repo}/blobs/{digest}")
        assert r.status_code == 200 and r.headers["docker-content-digest"] == digest
        assert r.headers["content-length"] == str(len(data))
        r = c.get(f"/v2/{repo}/blobs/{digest}")
        assert r.content == data and r.headers["docker-content-digest"] == digest
        r = c.get(f"/v2/{repo}/blobs/{digest}", headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == data[10:20]
        # The sha256 of the same bytes is another blob, not pushed.
        assert c.head(f"/v2/{repo}/blobs/{sha(data)}").status_code == 404

        r = c.post(f"/v2/{other}/blobs/uploads/", params={"mount": digest, "from": repo})
        assert r.status_code == 201, r.text
        assert r.headers["docker-content-digest"] == digest
        assert c.get(f"/v2/{other}/blobs/{digest}").content == data

        # The same bytes pushed again (the store has them: the client's bytes are checked
        # by sha512), once right and once wrong.
        assert push512(c, f"{user[0]}/third", data) == digest
        r = c.post(
            f"/v2/{user[0]}/fourth/blobs/uploads/", params={"digest": digest}, content=data + b"!"
        )
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"

        assert c.delete(f"/v2/{repo}/blobs/{digest}").status_code == 202
        r = c.get(f"/v2/{repo}/blobs/{digest}")
        assert r.status_code == 404 and error_code(r) == "BLOB_UNKNOWN"
        assert c.delete(f"/v2/{repo}/blobs/{digest}").status_code == 404
        assert c.get(f"/v2/{other}/blobs/{digest}").content == data  # the mount stays


@pytest.mark.parametrize("way", ["post-put", "chunked"])
def test_sha512_blob_through_a_session(hub: HubServer, user: tuple[str, str], way: str) -> None:
    repo = f"{user[0]}/app"
    data = bytes(range(256)) * 300
    digest = sha512(data)
    with hub.client(auth=user) as c:
        if way == "post-put":
            location = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
            r = c.put(location, params={"digest": digest}, content=data)
        else:
            r = push_chunked(c, repo, data, digest, step=20_000)
        assert r.status_code == 201, r.text
        assert r.headers["docker-content-digest"] == digest
        assert c.get(f"/v2/{repo}/blobs/{digest}").content == data


@pytest.mark.parametrize("way", ["monolithic", "post-put", "chunked"])
def test_wrong_sha512_is_refused_and_stores_nothing(
    hub: HubServer, user: tuple[str, str], way: str
) -> None:
    repo = f"{user[0]}/app"
    data = b"the bytes sent" * 5000
    wrong = sha512(data + b"x")
    with hub.client(auth=user) as c:
        if way == "monolithic":
            r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": wrong}, content=data)
        elif way == "post-put":
            location = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
            r = c.put(location, params={"digest": wrong}, content=data)
        else:
            r = push_chunked(c, repo, data, wrong, step=30_000)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        assert c.head(f"/v2/{repo}/blobs/{wrong}").status_code == 404
        assert c.head(f"/v2/{repo}/blobs/{sha512(data)}").status_code == 404
    store = FsBlobStore(hub.data_dir / "blobs")
    assert not store.has(wrong) and not store.has(sha512(data))


def test_malformed_sha512_is_digest_invalid(hub: HubServer, user: tuple[str, str]) -> None:
    repo = f"{user[0]}/app"
    hexd = sha512(b"y")[7:]
    with hub.client(auth=user) as c:
        push512(c, repo, b"y")  # the repository exists: a 400 is about the digest
        for bad in ["sha512:" + hexd[:-1], "sha512:" + hexd + "a", "sha512:" + hexd.upper()]:
            for r in (
                c.head(f"/v2/{repo}/blobs/{bad}"),
                c.get(f"/v2/{repo}/blobs/{bad}"),
                c.delete(f"/v2/{repo}/blobs/{bad}"),
                c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": bad}, content=b"y"),
                c.get(f"/v2/{repo}/referrers/{bad}"),
            ):
                assert r.status_code == 400, (bad, r.request.method, r.text)
                if r.request.method != "HEAD":
                    assert error_code(r) == "DIGEST_INVALID"
            location = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
            r = c.put(location, params={"digest": bad}, content=b"y")
            assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
            r = c.post(f"/v2/{repo}/blobs/uploads/", params={"mount": bad, "from": repo})
            assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
            r = put_manifest(c, repo, bad, b"{}")
            assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
            for r in (
                c.get(f"/v2/{repo}/manifests/{bad}"),
                c.delete(f"/v2/{repo}/manifests/{bad}"),
            ):
                assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
            assert c.head(f"/v2/{repo}/manifests/{bad}").status_code == 400


def test_manifest_with_sha512_descriptors_and_put_by_sha512(backend_hub: HubServer) -> None:
    """On SQLite and PostgreSQL (which, unlike SQLite, enforces the digest columns' width)."""
    hub = backend_hub
    user = hub.add_user("manifest512")
    repo = f"{user[0]}/app"
    layer_data = b"sha512 layer"
    with hub.client(auth=user) as c:
        config, layer = push512(c, repo, EMPTY_CONFIG), push512(c, repo, layer_data)
        body = manifest_of(config, layer, len(layer_data))

        r = put_manifest(c, repo, "v1", body)  # by tag: the manifest is known by sha256
        assert r.status_code == 201, r.text
        assert r.headers["docker-content-digest"] == sha(body)
        r = c.get(f"/v2/{repo}/manifests/v1", headers={"Accept": OCI_MANIFEST})
        assert r.content == body

        long = sha512(body)  # by its sha512: verified, stored and answered as sha512
        r = put_manifest(c, repo, long, body)
        assert r.status_code == 201, r.text
        assert r.headers["docker-content-digest"] == long
        assert r.headers["location"] == f"/v2/{repo}/manifests/{long}"
        for method in ("GET", "HEAD"):
            r = c.request(method, f"/v2/{repo}/manifests/{long}", headers={"Accept": OCI_MANIFEST})
            assert r.status_code == 200 and r.headers["docker-content-digest"] == long
            assert r.headers["content-length"] == str(len(body))
        assert c.get(f"/v2/{repo}/manifests/{long}").content == body
        assert FsBlobStore(hub.data_dir / "blobs").read(long, len(body)) == body

        # The reference is checked with its own algorithm.
        r = put_manifest(c, repo, sha512(body + b" "), body)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"

        # A referrer whose subject is the sha512 manifest.
        subject = {"mediaType": OCI_MANIFEST, "digest": long, "size": len(body)}
        referrer = manifest_of(config, layer, len(layer_data), subject=subject)
        r = put_manifest(c, repo, sha512(referrer), referrer)
        assert r.status_code == 201 and r.headers["oci-subject"] == long
        listed = c.get(f"/v2/{repo}/referrers/{long}").json()["manifests"]
        assert [d["digest"] for d in listed] == [sha512(referrer)]

        # A sha512 descriptor of a blob the repository does not have, or malformed.
        missing = manifest_of(config, sha512(b"never pushed"), 12)
        r = put_manifest(c, repo, "v2", missing)
        assert r.status_code == 400 and error_code(r) == "MANIFEST_BLOB_UNKNOWN"
        for bad in ("sha512:" + layer[7:].upper(), layer[:-1], "sha384:" + "0" * 96):
            r = put_manifest(c, repo, "v2", manifest_of(config, bad, len(layer_data)))
            assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID", bad

        assert c.delete(f"/v2/{repo}/manifests/{sha512(referrer)}").status_code == 202
        assert c.get(f"/v2/{repo}/manifests/{sha512(referrer)}").status_code == 404


def test_gc_keeps_referenced_sha512_blobs_and_sweeps_the_rest(fresh_hub: HubServer) -> None:
    user = fresh_hub.add_user("gc512")
    repo = "gc512/app"
    store = FsBlobStore(fresh_hub.data_dir / "blobs")
    with fresh_hub.client(auth=user) as c:
        config, layer = push512(c, repo, EMPTY_CONFIG), push512(c, repo, b"kept layer")
        body = manifest_of(config, layer, len(b"kept layer"))
        assert put_manifest(c, repo, sha512(body), body).status_code == 201
        loose = push512(c, repo, b"never referenced")
    orphan = store.put_bytes(b"file without a row", sha512(b"file without a row"))

    out = fresh_hub.cli("gc")  # default grace: everything is too fresh to go
    assert out.startswith("removed 0 blobs") and "0 orphan files" in out
    assert store.has(loose) and store.has(orphan)

    out = fresh_hub.cli("gc", "--grace-minutes", "0")
    assert out.startswith("removed 1 blobs") and "1 orphan files" in out, out
    assert not store.has(loose) and not store.has(orphan)
    for digest in (config, layer, sha512(body)):
        assert store.has(digest)
    with fresh_hub.client(auth=user) as c:
        assert c.get(f"/v2/{repo}/manifests/{sha512(body)}").content == body
        assert c.get(f"/v2/{repo}/blobs/{layer}").content == b"kept layer"
        assert c.get(f"/v2/{repo}/blobs/{loose}").status_code == 404


# -- the same on the S3 backend --------------------------------------------------------------




def test_sha512_on_the_s3_backend(
    s3_hub: S3Hub, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = s3_hub.add_user("s3sha512")
    repo = "s3sha512/app"
    big = bytes(range(256)) * (40 * 1024)  # 10 MiB: a multipart upload (8 MiB parts)

    def key(digest: str) -> str:
        algorithm, hexd = dg.parse(digest)
        return f"{PREFIX}/blobs/{algorithm}/{hexd}"

    with s3_hub.client(auth=user) as c:
        r = push_chunked(c, repo, big, sha512(big + b"!"), step=3 * MiB)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        assert s3_hub.objects() == set() and s3_hub.leftovers() == []
        r = push_chunked(c, repo, big, sha512(big), step=3 * MiB)
        assert r.status_code == 201, r.text
        config, layer = push512(c, repo, EMPTY_CONFIG), sha512(big)
        r = c.get(f"/v2/{repo}/blobs/{layer}", headers={"Range": "bytes=9000000-9000009"})
        assert r.status_code == 206 and r.content == big[9_000_000:9_000_010]
        body = manifest_of(config, layer, len(big))
        assert put_manifest(c, repo, sha512(body), body).status_code == 201
        assert c.get(f"/v2/{repo}/manifests/{sha512(body)}").content == body
        loose = push512(c, repo, b"never referenced")
    assert {key(d) for d in (config, layer, sha512(body), loose)} == s3_hub.objects()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_CREDENTIALS["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_CREDENTIALS["secret_access_key"])
    monkeypatch.setenv("FORKD_HUB_S3_REGION", "us-east-1")
    monkeypatch.setenv("FORKD_HUB_S3_PREFIX", PREFIX)
    argv = ["gc", "--data", str(s3_hub.data_dir), "--grace-minutes", "0"]
    argv += ["--blob-backend", "s3", "--s3-bucket", s3_hub.bucket, "--s3-endpoint", moto_server.url]
    result = CliRunner().invoke(hub_group, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("removed 1 blobs"), result.output
    assert s3_hub.objects() == {key(d) for d in (config, layer, sha512(body))}
