"""Three hub replicas (own data directories) on one PostgreSQL and one S3 bucket behind
HAProxy: a session continued by any replica, push on one and pull on another, GC
beside pushes, revocation, shared limits and quotas, and a replica killed mid-push."""

from __future__ import annotations

import os

import httpx
from hub_support import sha
from replica_support import S3_PREFIX, ReplicaSet, fresh_replicas, replicas  # noqa: F401

from hub_server import ADMIN

MiB = 1 << 20


def _path(location: str) -> str:
    """An upload Location (absolute or not) as a path for another base URL."""
    url = httpx.URL(location)
    return url.raw_path.decode()


def _upload_objects(replicas: ReplicaSet) -> set[str]:
    return {k for k in replicas.objects() if k.startswith(f"{S3_PREFIX}/uploads/")}


def test_a_chunked_upload_continues_on_every_replica(replicas: ReplicaSet) -> None:
    a, b, c = replicas.replicas
    repo = "library/chunked"
    parts = [os.urandom(300_000), os.urandom(200_000), os.urandom(1000)]
    blob = b"".join(parts)
    digest = sha(blob)
    with (
        replicas.client(ADMIN, via=a) as on_a,
        replicas.client(ADMIN, via=b) as on_b,
        replicas.client(ADMIN, via=c) as on_c,
    ):
        r = on_a.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = _path(r.headers["location"])
        offset = 0
        for client, part in ((on_b, parts[0]), (on_c, parts[1])):
            r = client.patch(
                location,
                content=part,
                headers={"Content-Range": f"{offset}-{offset + len(part) - 1}"},
            )
            assert r.status_code == 202, r.text
            offset += len(part)
            assert r.headers["range"] == f"0-{offset - 1}"
            location = _path(r.headers["location"])
        # Any replica reports the session's progress (GET on the upload).
        status = on_a.get(location)
        assert status.status_code == 204 and status.headers["range"] == f"0-{offset - 1}"
        # A chunk that does not start where the upload ends is refused by any replica.
        stale = on_b.patch(location, content=b"x", headers={"Content-Range": "0-0"})
        assert stale.status_code == 416
        r = on_a.put(location, params={"digest": digest}, content=parts[2])
        assert r.status_code == 201, r.text
    with replicas.client(ADMIN) as balanced:
        got = balanced.get(f"/v2/{repo}/blobs/{digest}")
        assert got.status_code == 200 and got.content == blob
    assert not _upload_objects(replicas)  # the chunks went with the session
    for replica in replicas.replicas:  # no staging bytes left in any data directory
        assert not any(p.stat().st_size for p in (replica.data_dir / "uploads").iterdir())
