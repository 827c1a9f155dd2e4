"""Hostile review 23: storage an account controls.

1. An upload naming a blob its namespace already holds (``POST ?digest=D``, or the
   closing ``PUT ?digest=D`` of a session) skipped the quota's reservation altogether:
   the blob "costs nothing" once stored, so its bytes in flight were not limited either.
   But until they are hashed they are any bytes the client sends: a namespace at its
   quota streamed up to ``upload_max_bytes`` (16 GiB) per request, in up to
   ``upload_sessions_max`` requests at once, onto the hub's disk, and was told
   DIGEST_INVALID only at the end. Now such an upload may hold the held blob's size more
   than the quota leaves (a copy of a blob the namespace has is free once stored), and no
   more: past it, 403 DENIED as for any upload, before the bytes are written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from hub_support import ADMIN, HubServer, error_code, push_blob


def _used(hub: HubServer, ns: str) -> int:
    with hub.client(ADMIN) as c:
        r = c.get(f"/api/v1/namespaces/{ns}/quota")
        assert r.status_code == 200, r.text
        return int(r.json()["used_bytes"])


def _chunks(size: int, count: int) -> Iterator[bytes]:
    """A body without Content-Length (chunked transfer, as ``docker push`` sends)."""
    for _ in range(count):
        yield os.urandom(size)


def _uploads_dir_bytes(hub: HubServer) -> int:
    uploads = hub.data_dir / "uploads"
    return sum(p.stat().st_size for p in uploads.iterdir()) if uploads.exists() else 0


def test_an_upload_naming_a_held_blob_is_still_bounded_by_the_quota(
    backend_hub: HubServer,
) -> None:
    hub = backend_hub
    who = hub.add_user("heldblob")
    ns = who[0]
    hub.cli("quota", "set", ns, "1000")
    held = os.urandom(600)
    with hub.client(who) as c:
        digest = push_blob(c, f"{ns}/one", held)
        assert _used(hub, ns) == 600

        # Monolithic, with Content-Length: refused before a byte is read.
        junk = os.urandom(5000)
        r = c.post(f"/v2/{ns}/one/blobs/uploads/", params={"digest": digest}, content=junk)
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert "quota" in r.json()["errors"][0]["message"]

        # The closing PUT of a session, chunked: refused at the first chunk past the room.
        location = c.post(f"/v2/{ns}/two/blobs/uploads/").headers["Location"]
        r = c.put(location, params={"digest": digest}, content=_chunks(64 * 1024, 64))
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert _uploads_dir_bytes(hub) == 0
        assert c.delete(location).status_code == 204

        # The blob itself, sent again into another repository of the namespace, still
        # costs nothing: it fits in what the quota leaves plus its own size.
        assert push_blob(c, f"{ns}/three", held) == digest
        chunked = c.post(f"/v2/{ns}/four/blobs/uploads/").headers["Location"]
        r = c.put(chunked, params={"digest": digest}, content=iter([held[:300], held[300:]]))
        assert r.status_code == 201, r.text
        assert c.head(f"/v2/{ns}/four/blobs/{digest}").status_code == 200
    assert _used(hub, ns) == 600

