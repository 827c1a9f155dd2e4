"""Upload sessions are bounded (issue 10 items 8, 13b, 13c): a cap on open sessions per
namespace, a size cap per session, open sessions' bytes counted against the quota,
idle sessions expired (answered BLOB_UPLOAD_UNKNOWN, files deleted by the hub itself and
by gc), a session whose data file vanished answered BLOB_UPLOAD_UNKNOWN, manifest
bodies counted in the quota, and gc removing stale temporary blob files."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_support import ADMIN, HubServer, artifact, error_code, push_blob, sha


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(
        tmp_path_factory.mktemp("limited"),
        {"upload_sessions_max": 3, "upload_max_bytes": 1000},
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def expiring(tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"upload_idle_timeout": 3}).start()
    try:
        yield server
    finally:
        server.stop()


def _upload_file(hub: HubServer, location: str) -> Path:
    return hub.data_dir / "uploads" / location.rsplit("/", 1)[1]


def _backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _used(hub: HubServer, ns: str) -> int:
    with hub.client(ADMIN) as c:
        return int(c.get(f"/api/v1/namespaces/{ns}/quota").json()["used_bytes"])


def test_open_sessions_per_namespace_are_capped(limited: HubServer) -> None:
    who = limited.add_user("capped")
    other = limited.add_user("uncapped")
    with limited.client(who) as c, limited.client(other) as o:
        sessions = []
        for repo in ("capped/a", "capped/b", "capped/a"):
            r = c.post(f"/v2/{repo}/blobs/uploads/")
            assert r.status_code == 202, r.text
            sessions.append(r.headers["Location"])
        r = c.post("/v2/capped/c/blobs/uploads/")
        assert r.status_code == 429 and error_code(r) == "TOOMANYREQUESTS", r.text
        assert "3 open upload sessions" in r.text and "DELETE" in r.text
        # Another namespace has its own count; a monolithic upload holds a session while
        # its request runs, so it counts too (and gives its place back when done).
        assert o.post("/v2/uncapped/a/blobs/uploads/").status_code == 202
        r = c.post("/v2/capped/a/blobs/uploads/", params={"digest": sha(b"m")}, content=b"m")
        assert r.status_code == 429 and error_code(r) == "TOOMANYREQUESTS", r.text
        # Cancelling one frees its place.
        assert c.delete(sessions[0]).status_code == 204
        push_blob(c, "capped/a", b"monolithic")
        assert c.post("/v2/capped/c/blobs/uploads/").status_code == 202


def test_a_session_holds_at_most_upload_max_bytes(limited: HubServer) -> None:
    who = limited.add_user("sizecap")
    repo = "sizecap/app"
    with limited.client(who) as c:
        location = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
        assert c.patch(location, content=b"a" * 600).status_code == 202
        r = c.patch(location, content=b"b" * 500, headers={"Content-Range": "600-1099"})
        assert r.status_code == 413 and error_code(r) == "SIZE_INVALID", r.text
        assert "1000 bytes" in r.text
        # A body without a declared length is cut off the same way, keeping nothing of it.
        r = c.patch(location, content=iter([b"c" * 300, b"d" * 300]))
        assert r.status_code == 413, r.text
        assert c.get(location).headers["Range"] == "0-599"
        assert _upload_file(limited, location).stat().st_size == 600
        r = c.put(location, params={"digest": sha(b"a" * 600)}, content=b"")
        assert r.status_code == 201, r.text
        before = set((limited.data_dir / "uploads").iterdir())
        big = b"x" * 1001
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(big)}, content=big)
        assert r.status_code == 413, r.text
        assert c.head(f"/v2/{repo}/blobs/{sha(big)}").status_code == 404
        assert set((limited.data_dir / "uploads").iterdir()) == before
    assert not _upload_file(limited, location).exists()


def test_open_sessions_bytes_count_against_the_quota(limited: HubServer) -> None:
    who = limited.add_user("inflight")
    limited.cli("quota", "set", "inflight", "1000")
    with limited.client(who) as c:
        a = c.post("/v2/inflight/a/blobs/uploads/").headers["Location"]
        assert c.patch(a, content=b"a" * 700).status_code == 202
        b = c.post("/v2/inflight/b/blobs/uploads/").headers["Location"]
        r = c.patch(b, content=b"b" * 400)
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert "700 more held by open upload sessions" in r.text
        r = c.post("/v2/inflight/b/blobs/uploads/", params={"digest": sha(b"m" * 400)},
                   content=b"m" * 400)  # fmt: skip
        assert r.status_code == 403, r.text
        assert c.patch(b, content=b"b" * 300).status_code == 202  # exactly up to the quota
        assert c.delete(a).status_code == 204  # a cancelled session gives its bytes back
        assert (
            c.patch(b, content=b"b" * 400, headers={"Content-Range": "300-699"}).status_code == 202
        )
        assert c.put(b, params={"digest": sha(b"b" * 700)}).status_code == 201
    assert _used(limited, "inflight") == 700


def test_manifest_bodies_count_toward_the_quota(limited: HubServer) -> None:
    who = limited.add_user("manifests")
    limited.cli("quota", "set", "manifests", "100000")
    with limited.client(who) as c:
        digest, body = artifact(c, "manifests/app", b"layer")
        assert _used(limited, "manifests") == len(b"{}") + len(b"layer") + len(body)
        # The same manifest in a second repository of the namespace counts once.
        artifact(c, "manifests/copy", b"layer")
        assert _used(limited, "manifests") == len(b"{}") + len(b"layer") + len(body)
        assert c.delete(f"/v2/manifests/app/manifests/{digest}").status_code == 202
        assert _used(limited, "manifests") == len(b"{}") + len(b"layer") + len(body)
        assert c.delete(f"/v2/manifests/copy/manifests/{digest}").status_code == 202
        assert _used(limited, "manifests") == len(b"{}") + len(b"layer")
    limited.cli("quota", "set", "manifests", "7")  # recomputed from scratch: the same sum
    assert _used(limited, "manifests") == len(b"{}") + len(b"layer")


def test_idle_sessions_expire(expiring: HubServer) -> None:
    who = expiring.add_user("idler")
    with expiring.client(who) as c:
        old = c.post("/v2/idler/app/blobs/uploads/").headers["Location"]
        assert c.patch(old, content=b"partial").status_code == 202
        _backdate(_upload_file(expiring, old), 10)
        for request in (
            lambda: c.patch(old, content=b"more", headers={"Content-Range": "7-10"}),
            lambda: c.get(old),
            lambda: c.put(old, params={"digest": sha(b"partial")}),
        ):
            r = request()
            assert r.status_code == 404 and error_code(r) == "BLOB_UPLOAD_UNKNOWN", r.text
        assert not _upload_file(expiring, old).exists()

        # Untouched by any request, an expired session goes by the hub's periodic sweep.
        forgotten = c.post("/v2/idler/app/blobs/uploads/").headers["Location"]
        _backdate(_upload_file(expiring, forgotten), 10)
        deadline = time.monotonic() + 30
        while _upload_file(expiring, forgotten).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _upload_file(expiring, forgotten).exists()
        assert c.get(forgotten).status_code == 404


def test_gc_drops_sessions_idle_past_the_hubs_timeout(expiring: HubServer) -> None:
    who = expiring.add_user("gcidle")
    with expiring.client(who) as c:
        location = c.post("/v2/gcidle/app/blobs/uploads/").headers["Location"]
    expiring.stop()  # no periodic sweep: gc alone, with its default TTL (1 h, not 24 h)
    _backdate(_upload_file(expiring, location), 2 * 3600)
    assert "1 stale uploads" in expiring.cli("gc")
    assert not _upload_file(expiring, location).exists()


@pytest.mark.parametrize("method", ["PATCH", "PUT", "GET"])
def test_a_session_without_its_data_file_is_unknown(limited: HubServer, method: str) -> None:
    who = limited.add_user(f"vanished{method.lower()}")
    repo = f"{who[0]}/app"
    with limited.client(who) as c:
        location = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
        assert c.patch(location, content=b"some bytes").status_code == 202
        _upload_file(limited, location).unlink()
        params = {"digest": sha(b"some bytes")} if method == "PUT" else {}
        r = c.request(method, location, params=params, content=b"" if method != "GET" else None)
        assert r.status_code == 404 and error_code(r) == "BLOB_UPLOAD_UNKNOWN", r.text
        # The session is gone for good, and a new upload works.
        assert c.get(location).status_code == 404
        push_blob(c, repo, b"some bytes")


def test_gc_removes_stale_temporary_files_but_not_fresh_or_locked_ones(
    fresh_hub: HubServer,
) -> None:
    tmp = fresh_hub.data_dir / "blobs" / "tmp"
    stale, fresh, locked = tmp / "blob-stale", tmp / "blob-fresh", tmp / "blob-writing"
    for path in (stale, fresh, locked):
        path.write_bytes(b"partial write" * 1000)
    _backdate(stale, 7200)
    _backdate(locked, 7200)
    with open(locked, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_SH)  # as FsBlobStore.put_stream holds it
        out = fresh_hub.cli("gc", "--dry-run")
        assert "would remove" in out and "1 temporary files" in out
        assert stale.exists()
        out = fresh_hub.cli("gc")
        assert "1 temporary files" in out
    assert not stale.exists() and fresh.exists() and locked.exists()
    # Not even a grace of zero judges a file in the instant between its creation and its
    # writer's lock (the racing-GC test pushes with such a sweep running).
    assert "1 temporary files" in fresh_hub.cli("gc", "--grace-minutes", "0")  # unlocked now
    assert fresh.exists() and not locked.exists()
    _backdate(fresh, 7200)
    assert "1 temporary files" in fresh_hub.cli("gc")
    assert list(tmp.iterdir()) == []
