"""Blobs and uploads: monolithic, chunked, resumed, verified, mounted, ranged, deleted."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from hub_support import TIMEOUT, HubServer, error_code, push_blob, sha


def _stored(hub: HubServer, digest: str) -> bool:
    hexd = digest.split(":", 1)[1]
    return (hub.data_dir / "blobs" / "sha256" / hexd[:2] / hexd).is_file()


def test_monolithic_push_then_get_head_range(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/blobs"
    data = bytes(range(256)) * 40
    with hub.client(auth=user) as c:
        digest = push_blob(c, name, data)
        r = c.get(f"/v2/{name}/blobs/{digest}")
        assert r.status_code == 200 and r.content == data
        assert r.headers["docker-content-digest"] == digest
        r = c.head(f"/v2/{name}/blobs/{digest}")
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-length"] == str(len(data))
        r = c.get(f"/v2/{name}/blobs/{digest}", headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == data[10:20]
        assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
        r = c.get(f"/v2/{name}/blobs/{digest}", headers={"Range": "bytes=10000-"})
        assert r.status_code == 206 and r.content == data[10000:]
        r = c.get(f"/v2/{name}/blobs/{digest}", headers={"Range": "bytes=-5"})
        assert r.status_code == 206 and r.content == data[-5:]
        r = c.get(f"/v2/{name}/blobs/{digest}", headers={"Range": f"bytes={len(data)}-"})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
    assert _stored(hub, digest)


def test_unknown_and_invalid_blobs(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/blobs"
    with hub.client(auth=user) as c:
        push_blob(c, name, b"make the repository exist")
        r = c.get(f"/v2/{name}/blobs/{sha(b'never pushed')}")
        assert r.status_code == 404 and error_code(r) == "BLOB_UNKNOWN"
        assert c.head(f"/v2/{name}/blobs/{sha(b'never pushed')}").status_code == 404
        r = c.get(f"/v2/{name}/blobs/sha256:xyz")
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        r = c.get(f"/v2/{user[0]}/Bad..Name/blobs/{sha(b'x')}")
        assert r.status_code == 400 and error_code(r) == "NAME_INVALID"
        r = c.get(f"/v2/{user[0]}/missing/blobs/{sha(b'x')}")
        assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN"
        r = c.put(f"/v2/{name}/blobs/{sha(b'x')}")
        assert r.status_code == 405 and error_code(r) == "UNSUPPORTED"
        r = c.get(f"/v2/{name}/nothing/here")
        assert r.status_code == 404


def test_blob_stored_once_across_repositories(hub: HubServer, user: tuple[str, str]) -> None:
    data = b"shared across repositories"
    with hub.client(auth=user) as c:
        d1 = push_blob(c, f"{user[0]}/one", data)
        d2 = push_blob(c, f"{user[0]}/two", data)
    assert d1 == d2 and _stored(hub, d1)
    files = list((hub.data_dir / "blobs" / "sha256").rglob(d1.split(":")[1]))
    assert len(files) == 1


def test_chunked_upload_with_status_and_out_of_order_chunk(
    hub: HubServer, user: tuple[str, str]
) -> None:
    name = f"{user[0]}/chunked"
    data = b"0123456789" * 1000
    with hub.client(auth=user) as c:
        r = c.post(f"/v2/{name}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["location"]
        assert location.startswith(f"/v2/{name}/blobs/uploads/")
        r = c.patch(
            location,
            content=data[:4000],
            headers={"Content-Range": "0-3999", "Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 202 and r.headers["range"] == "0-3999"
        location = r.headers["location"]
        r = c.patch(location, content=data[5000:6000], headers={"Content-Range": "5000-5999"})
        assert r.status_code == 416 and r.headers["range"] == "0-3999"
        r = c.get(location)
        assert r.status_code == 204 and r.headers["range"] == "0-3999"
        r = c.patch(location, content=data[4000:9000], headers={"Content-Range": "4000-8999"})
        assert r.status_code == 202 and r.headers["range"] == "0-8999"
        r = c.put(location, params={"digest": sha(data)}, content=data[9000:])
        assert r.status_code == 201, r.text
        assert r.headers["location"] == f"/v2/{name}/blobs/{sha(data)}"
        assert c.get(r.headers["location"]).content == data
        # The session is gone once finished.
        assert c.get(location).status_code == 404
        r = c.patch(f"/v2/{name}/blobs/uploads/{'0' * 32}", content=b"x")
        assert r.status_code == 404 and error_code(r) == "BLOB_UPLOAD_UNKNOWN"
        r = c.get(f"/v2/{name}/blobs/uploads/..%2F..%2Fetc")
        assert r.status_code in (400, 404)


def test_digest_mismatch_stores_nothing(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/mismatch"
    data, claimed = b"the real bytes", sha(b"other bytes")
    with hub.client(auth=user) as c:
        r = c.post(f"/v2/{name}/blobs/uploads/", params={"digest": claimed}, content=data)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        location = c.post(f"/v2/{name}/blobs/uploads/").headers["location"]
        c.patch(location, content=data)
        r = c.put(location, params={"digest": claimed})
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        assert c.get(location).status_code == 404  # session dropped
        assert c.head(f"/v2/{name}/blobs/{claimed}").status_code == 404
        assert c.head(f"/v2/{name}/blobs/{sha(data)}").status_code == 404
        r = c.put(c.post(f"/v2/{name}/blobs/uploads/").headers["location"], params={"digest": "x"})
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
    assert not _stored(hub, claimed) and not _stored(hub, sha(data))
    assert list((hub.data_dir / "blobs" / "tmp").iterdir()) == []

    # Wrong bytes under the digest of a blob the hub already has are refused too.
    with hub.client(auth=user) as c:
        known = push_blob(c, name, b"already stored")
        r = c.post(f"/v2/{name}/blobs/uploads/", params={"digest": known}, content=b"forged")
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
        assert c.get(f"/v2/{name}/blobs/{known}").content == b"already stored"


def test_cancel_upload(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/cancel"
    with hub.client(auth=user) as c:
        location = c.post(f"/v2/{name}/blobs/uploads/").headers["location"]
        c.patch(location, content=b"some bytes")
        assert c.delete(location).status_code == 204
        assert c.get(location).status_code == 404
        assert c.delete(location).status_code == 404
    upload_id = location.rsplit("/", 1)[1]
    assert not (hub.data_dir / "uploads" / upload_id).exists()


def test_interrupted_chunk_is_resumed(hub: HubServer, user: tuple[str, str]) -> None:
    """A PATCH cut off mid-body keeps what arrived; the client asks where to resume."""
    name = f"{user[0]}/resume"
    data = bytes(range(256)) * 4096  # 1 MiB
    with hub.client(auth=user) as c:
        location = c.post(f"/v2/{name}/blobs/uploads/").headers["location"]
    auth = httpx.BasicAuth(*user)
    request = httpx.Request("PATCH", f"{hub.url}{location}")
    header = next(auth.auth_flow(request)).headers["authorization"]
    sent = 300_000
    with socket.create_connection(("127.0.0.1", hub.port)) as s:
        s.sendall(
            (
                f"PATCH {location} HTTP/1.1\r\nHost: {hub.address}\r\n"
                f"Authorization: {header}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            ).encode()
            + data[:sent]
        )
        time.sleep(0.5)  # let the server write what arrived before the connection drops
    with hub.client(auth=user) as c:
        deadline = time.monotonic() + TIMEOUT  # was 10 s: short for a loaded machine
        while True:  # the server notices the disconnect asynchronously
            r = c.get(location)
            assert r.status_code == 204
            have = int(r.headers["range"].split("-")[1]) + 1
            if have == sent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert have == sent
        r = c.patch(
            location, content=data[have:], headers={"Content-Range": f"{have}-{len(data) - 1}"}
        )
        assert r.status_code == 202
        r = c.put(location, params={"digest": sha(data)})
        assert r.status_code == 201, r.text
        assert c.get(f"/v2/{name}/blobs/{sha(data)}").content == data


def test_concurrent_pushes_of_the_same_blob(backend_hub: HubServer) -> None:
    """Eight clients push one blob into two new repositories at once (first-push races)."""
    hub = backend_hub
    user = hub.add_user("racer")
    data = b"pushed by many at once" * 50_000
    results: list[int] = []

    def push(i: int) -> None:
        with hub.client(auth=user) as c:
            repo = f"{user[0]}/race{i % 2}"
            if i % 3:
                r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(data)}, content=data)
            else:
                loc = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
                c.patch(loc, content=data)
                r = c.put(loc, params={"digest": sha(data)})
            results.append(r.status_code)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [201] * 8
    with hub.client(auth=user) as c:
        for repo in ("race0", "race1"):
            assert c.get(f"/v2/{user[0]}/{repo}/blobs/{sha(data)}").content == data
    assert len(list((hub.data_dir / "blobs" / "sha256").rglob(sha(data).split(":")[1]))) == 1


def test_cross_repository_mount(hub: HubServer, user: tuple[str, str]) -> None:
    data = b"mount me"
    source, target = f"{user[0]}/source", f"{user[0]}/target"
    with hub.client(auth=user) as c:
        digest = push_blob(c, source, data)
        r = c.post(f"/v2/{target}/blobs/uploads/", params={"mount": digest, "from": source})
        assert r.status_code == 201 and r.headers["location"] == f"/v2/{target}/blobs/{digest}"
        assert c.get(f"/v2/{target}/blobs/{digest}").content == data
        # Unknown source blob: fall back to a normal upload session.
        r = c.post(f"/v2/{target}/blobs/uploads/", params={"mount": sha(b"absent"), "from": source})
        assert r.status_code == 202 and "/blobs/uploads/" in r.headers["location"]
    # Someone who cannot read the source cannot mount from it.
    other = hub.add_user(f"{user[0]}m")
    with hub.client(auth=other) as c:
        r = c.post(
            f"/v2/{other[0]}/stolen/blobs/uploads/", params={"mount": digest, "from": source}
        )
        assert r.status_code == 202
        assert c.head(f"/v2/{other[0]}/stolen/blobs/{digest}").status_code == 404


def test_delete_blob_unlinks_only_this_repository(hub: HubServer, user: tuple[str, str]) -> None:
    data = b"delete me here"
    with hub.client(auth=user) as c:
        digest = push_blob(c, f"{user[0]}/a", data)
        push_blob(c, f"{user[0]}/b", data)
        assert c.delete(f"/v2/{user[0]}/a/blobs/{digest}").status_code == 202
        assert c.head(f"/v2/{user[0]}/a/blobs/{digest}").status_code == 404
        assert c.delete(f"/v2/{user[0]}/a/blobs/{digest}").status_code == 404
        assert c.get(f"/v2/{user[0]}/b/blobs/{digest}").content == data
