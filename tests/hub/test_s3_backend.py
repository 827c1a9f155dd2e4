"""The hub with its blobs in S3 (a real moto_server): a forkd chain pushed and pulled,
ranged blob reads, a digest-mismatched upload leaving nothing in the bucket, GC, and the
start-up checks of the S3 settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hub_support import error_code, push_blob, sha
from s3_hub_support import PREFIX, S3Hub, s3_settings
from s3_support import (
    MOTO_CREDENTIALS,
    MotoServer,
)

from forkd.cli.hub_cmds import hub as hub_group
from forkd.errors import InvalidInput
from forkd.hub.app import create_app
from forkd.hub.settings import HubSettings
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store

MiB = 1 << 20


def test_push_pull_chain_with_blobs_in_s3(
    s3_hub: S3Hub, store: Store, chain: list[str], images: list[Path], tmp_path: Path
) -> None:
    user = s3_hub.add_user("s3user")
    target = Hub(s3_hub.address, "http")
    remote = parse_remote(f"{target}/s3user/app:v1")
    with RegistryClient(target, Credential(*user)) as client:
        first = push(store, "d3", remote, client)
        assert first.layers == 4 and first.blobs_sent > 0
        assert push(store, "d3", remote, client).blobs_sent == 0  # only missing blobs travel
        other = Store(tmp_path / "other")
        got = pull(other, remote, client)
        assert got.digest == store.resolve("d3")
        assert other.assemble("s3user/app:v1").memory.read_bytes() == images[3].read_bytes()
    # Every blob (manifests too) is in the bucket; nothing went to the data directory.
    assert s3_hub.key(got.digest) in s3_hub.objects()
    assert not (s3_hub.data_dir / "blobs").exists()

    # Ranged reads stream from S3 through the store's seekable reader.
    with s3_hub.client(auth=user) as c:
        data = bytes(range(256)) * 40_000  # ~10 MiB: more than one read buffer
        digest = push_blob(c, "s3user/app", data)
        assert s3_hub.key(digest) in s3_hub.objects()
        r = c.get(f"/v2/s3user/app/blobs/{digest}", headers={"Range": "bytes=5000000-5000099"})
        assert r.status_code == 206 and r.content == data[5_000_000:5_000_100]
        r = c.get(f"/v2/s3user/app/blobs/{digest}", headers={"Range": "bytes=-10"})
        assert r.status_code == 206 and r.content == data[-10:]
        assert c.get(f"/v2/s3user/app/blobs/{digest}").content == data


@pytest.mark.parametrize("size", [100, 12 * MiB], ids=["small", "multipart"])
def test_digest_mismatched_upload_leaves_nothing_in_the_bucket(s3_hub: S3Hub, size: int) -> None:
    user = s3_hub.add_user("s3mismatch")
    data = bytes(size)
    wrong = sha(data + b"x")
    with s3_hub.client(auth=user) as c:
        before = s3_hub.objects()
        r = c.post("/v2/s3mismatch/app/blobs/uploads/", params={"digest": wrong}, content=data)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        # The same through a session: POST, PATCH, PUT with the wrong digest.
        location = c.post("/v2/s3mismatch/app/blobs/uploads/").headers["location"]
        assert c.patch(location, content=data).status_code == 202
        r = c.put(location, params={"digest": wrong})
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        assert s3_hub.objects() == before  # nothing stored, under any key
        assert s3_hub.leftovers() == []  # no unfinished multipart upload either
        r = c.get(f"/v2/s3mismatch/app/blobs/{wrong}")
        assert r.status_code == 404 and error_code(r) == "BLOB_UNKNOWN"
    assert list((s3_hub.data_dir / "uploads").iterdir()) == []


def test_gc_sweeps_the_bucket(
    s3_hub: S3Hub,
    moto_server: MotoServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = s3_hub.add_user("s3gc")
    with s3_hub.client(auth=user) as c:
        loose = push_blob(c, "s3gc/app", b"never referenced")
    orphan = sha(b"object without a row")
    moto_server.client().put_object(
        Bucket=s3_hub.bucket, Key=s3_hub.key(orphan), Body=b"object without a row"
    )
    # The CLI's S3 options, with credentials from the standard AWS environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_CREDENTIALS["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_CREDENTIALS["secret_access_key"])
    monkeypatch.setenv("FORKD_HUB_S3_REGION", "us-east-1")
    monkeypatch.setenv("FORKD_HUB_S3_PREFIX", PREFIX)
    argv = ["gc", "--data", str(s3_hub.data_dir), "--grace-minutes", "0"]
    argv += ["--blob-backend", "s3", "--s3-bucket", s3_hub.bucket, "--s3-endpoint", moto_server.url]
    result = CliRunner().invoke(hub_group, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("removed 1 blobs") and "1 orphan files" in result.output
    assert s3_hub.key(loose) not in s3_hub.objects()
    assert s3_hub.key(orphan) not in s3_hub.objects()


def test_s3_settings_are_checked_at_start(moto_server: MotoServer, tmp_path: Path) -> None:
    good = s3_settings(moto_server, moto_server.new_bucket())
    with pytest.raises(InvalidInput, match="needs a bucket"):
        HubSettings(tmp_path, **{**good, "s3_bucket": ""}).validated()
    with pytest.raises(InvalidInput, match="blob backend is 'fs'"):
        HubSettings(tmp_path, **{**good, "blob_backend": "fs"}).validated()
    with pytest.raises(InvalidInput, match="use fs or s3"):
        HubSettings(tmp_path, blob_backend="gcs").validated()
    with pytest.raises(InvalidInput, match="invalid S3 endpoint"):
        HubSettings(tmp_path, **{**good, "s3_endpoint_url": "minio:9000"}).validated()
    with pytest.raises(InvalidInput, match="or neither"):
        HubSettings(tmp_path, **{**good, "s3_secret_access_key": ""}).validated()
    with pytest.raises(InvalidInput, match="does not exist: create it"):
        create_app(HubSettings(tmp_path, **{**good, "s3_bucket": "no-such-bucket"}))

    # `forkd hub serve` with a missing bucket stops before serving, saying what to do.
    argv = ["serve", "--data", str(tmp_path), "--blob-backend", "s3"]
    argv += ["--s3-bucket", "no-such-bucket", "--s3-endpoint", moto_server.url]
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    result = CliRunner().invoke(hub_group, argv, env={**env, "AWS_DEFAULT_REGION": "us-east-1"})
    assert result.exit_code == InvalidInput.exit_code
    assert "no-such-bucket" in result.output and "does not exist" in result.output
