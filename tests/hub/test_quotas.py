"""Per-namespace storage quotas: blobs linked into a namespace's repositories, each counted
once; an upload or mount past the quota is DENIED with nothing stored."""

from __future__ import annotations

import os

from hub_support import ADMIN, HubServer, error_code, push_blob, sha

from forkd.store.blobs import FsBlobStore


def _stored(hub: HubServer, digest: str) -> bool:
    return FsBlobStore(hub.data_dir / "blobs").has(digest)


def _quota(hub: HubServer, ns: str) -> dict[str, object]:
    with hub.client(ADMIN) as c:
        r = c.get(f"/api/v1/namespaces/{ns}/quota")
        assert r.status_code == 200, r.text
        return dict(r.json())


def test_quota_refuses_uploads_and_stores_nothing(hub: HubServer, user: tuple[str, str]) -> None:
    ns = user[0]
    out = hub.cli("quota", "set", ns, "1000")
    assert "1000 bytes" in out
    a, b, too_big = os.urandom(600), os.urandom(300), os.urandom(200)
    with hub.client(user) as c:
        push_blob(c, f"{ns}/one", a)
        push_blob(c, f"{ns}/one", b)
        # The same blob in another repository of the namespace counts once.
        push_blob(c, f"{ns}/two", a)
        assert _quota(hub, ns) == {"namespace": ns, "quota_bytes": 1000, "used_bytes": 900}

        # Monolithic upload past the quota.
        r = c.post(f"/v2/{ns}/one/blobs/uploads/", params={"digest": sha(too_big)}, content=too_big)
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        message = r.json()["errors"][0]["message"]
        assert "quota" in message and ns in message and "1000" in message
        assert not _stored(hub, sha(too_big))
        assert c.head(f"/v2/{ns}/one/blobs/{sha(too_big)}").status_code == 404

        # Chunked session: bytes held by open sessions count, so the PATCH past the quota
        # is refused and keeps nothing; the session stays, empty, until cancelled.
        r = c.post(f"/v2/{ns}/one/blobs/uploads/")
        location = r.headers["Location"]
        r = c.patch(location, content=too_big, headers={"Content-Range": "0-199"})
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert "open upload sessions" in r.json()["errors"][0]["message"]
        assert c.get(location).headers["Range"] == "0-0"
        upload_file = hub.data_dir / "uploads" / location.rsplit("/", 1)[1]
        assert upload_file.stat().st_size == 0
        assert c.delete(location).status_code == 204
        assert not upload_file.exists()
        assert not _stored(hub, sha(too_big))
        assert _quota(hub, ns)["used_bytes"] == 900

        # Exactly up to the quota is fine.
        push_blob(c, f"{ns}/one", os.urandom(100))
        assert _quota(hub, ns)["used_bytes"] == 1000
    audit = (hub.data_dir / "audit.log").read_text()
    assert '"denied"' in audit and "storage quota" in audit


def test_quota_refuses_mount(hub: HubServer, user: tuple[str, str]) -> None:
    ns = user[0]
    big = os.urandom(500)
    with hub.client(ADMIN) as c:
        push_blob(c, "library/quota-src", big)
        c.post("/v2/library/quota-src/blobs/uploads/", params={"digest": sha(b"x")}, content=b"x")
    hub.public("library/quota-src")
    hub.cli("quota", "set", ns, "400")
    with hub.client(user) as c:
        push_blob(c, f"{ns}/m", b"first")  # creates the repository
        r = c.post(
            f"/v2/{ns}/m/blobs/uploads/",
            params={"mount": sha(big), "from": "library/quota-src"},
        )
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert c.head(f"/v2/{ns}/m/blobs/{sha(big)}").status_code == 404
        # A small one mounts.
        r = c.post(
            f"/v2/{ns}/m/blobs/uploads/", params={"mount": sha(b"x"), "from": "library/quota-src"}
        )
        assert r.status_code == 201, r.text
    assert _quota(hub, ns)["used_bytes"] == len(b"first") + 1


def test_quota_api_and_cli(hub: HubServer, user: tuple[str, str]) -> None:
    ns = user[0]
    with hub.client(user) as c:
        push_blob(c, f"{ns}/api", b"12345")
        r = c.get(f"/api/v1/namespaces/{ns}/quota")
        assert r.json() == {"namespace": ns, "quota_bytes": None, "used_bytes": 5}
        # Only site admins set quotas.
        r = c.put(f"/api/v1/namespaces/{ns}/quota", json={"quota_bytes": 10**9})
        assert r.status_code == 403
        assert c.get("/api/v1/namespaces/library/quota").status_code == 403
    with hub.client() as c:
        assert c.put(f"/api/v1/namespaces/{ns}/quota", json={"quota_bytes": 1}).status_code == 401
    with hub.client(ADMIN) as c:
        r = c.put(f"/api/v1/namespaces/{ns}/quota", json={"quota_bytes": 6})
        assert r.status_code == 200 and r.json()["quota_bytes"] == 6
        assert c.put(f"/api/v1/namespaces/{ns}/quota", json={"quota_bytes": -1}).status_code == 400
        r = c.put("/api/v1/namespaces/no-such-ns-x/quota", json={"quota_bytes": 1})
        assert r.status_code == 400
    with hub.client(user) as c:
        r = c.post(f"/v2/{ns}/api/blobs/uploads/", params={"digest": sha(b"ab")}, content=b"ab")
        assert r.status_code == 403
    assert "5 bytes used of 6" in hub.cli("quota", "show", ns)
    hub.cli("quota", "set", ns, "none")
    with hub.client(user) as c:
        push_blob(c, f"{ns}/api", b"ab")
    hub.cli("quota", "set", ns, "1KiB")
    assert "of 1024" in hub.cli("quota", "show", ns)


def test_concurrent_uploads_do_not_overshoot(backend_hub: HubServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    hub = backend_hub
    hub.cli("org", "add", "q")
    hub.cli("quota", "set", "q", "1000")
    blobs = [os.urandom(300) for _ in range(6)]

    def upload(i: int) -> int:
        with hub.client(ADMIN) as c:
            data = blobs[i]
            r = c.post(f"/v2/q/r{i % 2}/blobs/uploads/", params={"digest": sha(data)}, content=data)
            return r.status_code

    with ThreadPoolExecutor(6) as pool:
        codes = sorted(pool.map(upload, range(6)))
    assert codes == [201, 201, 201, 403, 403, 403], codes
    assert _quota(hub, "q")["used_bytes"] == 900
    stored = [d for d in blobs if _stored(hub, sha(d))]
    assert len(stored) == 3


def test_running_total_follows_links_unlinks_and_gc(backend_hub: HubServer) -> None:
    """The stored total (what checks use) always equals the namespace's distinct linked
    bytes: a blob in two repositories counts once, unlinking it from one keeps it, from
    both gives it back, a GC sweep gives back what it removes, and a total is computed
    for blobs already there when the quota is set."""
    hub = backend_hub
    hub.cli("org", "add", "rt")
    a, b, c_ = os.urandom(100), os.urandom(200), os.urandom(400)
    with hub.client(ADMIN) as c:
        push_blob(c, "rt/one", c_)  # before any quota: no total is kept
        hub.cli("quota", "set", "rt", "10000")
        assert _quota(hub, "rt")["used_bytes"] == 400  # computed when the quota is set
        push_blob(c, "rt/one", a)
        push_blob(c, "rt/one", b)
        push_blob(c, "rt/two", a)  # the same blob in a second repository: counted once
        assert _quota(hub, "rt")["used_bytes"] == 700
        assert c.delete(f"/v2/rt/one/blobs/{sha(a)}").status_code == 202
        assert _quota(hub, "rt")["used_bytes"] == 700  # rt/two still links it
        assert c.delete(f"/v2/rt/two/blobs/{sha(a)}").status_code == 202
        assert _quota(hub, "rt")["used_bytes"] == 600
    # Nothing references b or c (no manifest): a sweep without grace removes them.
    hub.cli("gc", "--grace-minutes", "0")
    assert _quota(hub, "rt")["used_bytes"] == 0
    with hub.client(ADMIN) as c:
        push_blob(c, "rt/one", b)
        assert _quota(hub, "rt")["used_bytes"] == 200
    hub.cli("quota", "set", "rt", "none")
    assert _quota(hub, "rt")["used_bytes"] == 200  # without a quota: computed on demand
