"""Hostile review 27: the OCI Distribution surface and its races.

1. On PostgreSQL, a tag moved by a manifest push while a ``DELETE`` of that tag ran was a
   500: the push read the tag's row, then updated it after the deletion had committed
   (0 rows: SQLAlchemy's StaleDataError), and the manifest was stored but not tagged;
   a tag deleted twice at once answered 202 twice.
2. An upload session a request was writing was judged by its file's time of change,
   which buffered writes leave behind: ``forkd hub gc`` (and the hub's sweep) expired
   it under the request, which wrote on into a deleted file and answered 202 for bytes
   that were gone; a session cancelled (``DELETE``) while a ``PATCH`` wrote it left that
   ``PATCH`` answering 202 and a ``Range`` for a session that no longer existed, and one
   cancelled while its closing ``PUT`` hashed the bytes (or, with S3, read its chunks)
   made that ``PUT`` a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hub_support import (
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    SlowBody,
    artifact,
    push_blob,
    sha,
    unique_name,
)
from s3_hub_support import S3Hub

from forkd.hub.storage import UploadArea

TIMEOUT = 60


@pytest.fixture
def pg_hub(postgres_url: str, tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"database_url": postgres_url}).start()
    try:
        yield server
    finally:
        server.stop()


def _manifest(c: Any, repo: str, payload: bytes) -> bytes:
    """A one-layer artifact's manifest whose blobs are in ``repo`` (not pushed itself)."""
    push_blob(c, repo, EMPTY_CONFIG)
    layer = push_blob(c, repo, payload)
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.test",
        "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
        "layers": [
            {"mediaType": "application/octet-stream", "digest": layer, "size": len(payload)}
        ],
    }
    return json.dumps(doc).encode()


class _RowHolder:
    """A transaction of its own that runs ``statement`` (holding the rows it changes) and
    commits only once ``waiters`` other transactions wait for it (``pg_locks``)."""

    def __init__(self, url: str, statement: str, *args: object, waiters: int = 1) -> None:
        self.url, self.statement, self.args, self.waiters = url, statement, args, waiters
        self.held = threading.Event()
        self.done = threading.Event()
        self.failed: list[BaseException] = []
        self.changed = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _RowHolder:
        self.thread.start()
        assert self.held.wait(TIMEOUT)
        assert not self.failed, self.failed
        return self

    def __exit__(self, *_: object) -> None:
        self.thread.join(TIMEOUT)
        assert not self.failed, self.failed

    def _run(self) -> None:
        try:
            asyncio.run(self._hold())
        except BaseException as exc:  # the test reports it
            self.failed.append(exc)
        finally:
            self.held.set()
            self.done.set()

    async def _hold(self) -> None:
        conn = await asyncpg.connect(self.url)
        waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted"
        try:
            async with conn.transaction():
                self.changed = await conn.execute(self.statement, *self.args)
                self.held.set()
                deadline = time.monotonic() + TIMEOUT
                while (await conn.fetchval(waiting) or 0) < self.waiters:
                    assert time.monotonic() < deadline, "no transaction came to wait"
                    await asyncio.sleep(0.02)
        finally:
            await conn.close()


def _pg_url(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


# -- 1. a tag deleted while a push moves it ------------------------------------------------
def test_tag_deleted_while_a_push_moves_it_is_moved(pg_hub: HubServer, postgres_url: str) -> None:
    """Before: with a ``DELETE /v2/NAME/manifests/TAG`` committing while a push moved that
    tag (PostgreSQL: the push read the row, then updated it), the push was a 500 and its
    manifest stood untagged. Now the push sets the tag in one statement (insert, or
    update the row there is): 201, and the tag names the pushed manifest."""
    alice = pg_hub.add_user(unique_name("alice"))
    repo = f"{alice[0]}/app"
    with pg_hub.client(alice) as c:
        artifact(c, repo, b"first", tag="v1")
        body = _manifest(c, repo, b"second")
        with _RowHolder(
            _pg_url(postgres_url), "DELETE FROM tags WHERE name = $1", "v1"
        ) as holder:
            assert holder.changed == "DELETE 1"
            r = c.put(f"/v2/{repo}/manifests/v1", content=body,
                      headers={"Content-Type": OCI_MANIFEST})
        assert r.status_code == 201, r.text
        got = c.get(f"/v2/{repo}/manifests/v1", headers={"Accept": OCI_MANIFEST})
        assert got.status_code == 200, got.text
        assert got.headers["Docker-Content-Digest"] == sha(body)


def test_tag_deleted_twice_at_once_is_deleted_once(pg_hub: HubServer, postgres_url: str) -> None:
    """Before: a ``DELETE`` of a tag that another deletion removed while it waited for the
    row (PostgreSQL) deleted nothing and answered 202, as if it had. Now the deletion is
    one statement whose row count decides: 404 MANIFEST_UNKNOWN."""
    alice = pg_hub.add_user(unique_name("alice"))
    repo = f"{alice[0]}/app"
    with pg_hub.client(alice) as c:
        artifact(c, repo, b"first", tag="v1")
        with _RowHolder(
            _pg_url(postgres_url), "DELETE FROM tags WHERE name = $1", "v1"
        ) as holder:
            assert holder.changed == "DELETE 1"
            r = c.delete(f"/v2/{repo}/manifests/v1")
        assert r.status_code == 404, r.text
        assert r.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN"


# -- 2. an upload session being written is not expired ------------------------------------
def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


@contextlib.contextmanager
def _patch_held(hub: HubServer, c: Any, location: str) -> Iterator[tuple[str, SlowBody, list[Any]]]:
    """A PATCH of 200 bytes to ``location`` from another thread, held after its first 100
    once it holds the session's lock: (the upload id, its body, its answer once given).
    On leaving, the rest is sent and the PATCH waited for."""
    uploads = UploadArea(hub.data_dir / "uploads")
    upload_id = location.rsplit("/", 1)[1]
    body = SlowBody([b"a" * 100, b"b" * 100])
    answers: list[Any] = []
    octets = {"Content-Type": "application/octet-stream"}
    patch = threading.Thread(
        target=lambda: answers.append(c.patch(location, content=body, headers=octets))
    )
    patch.start()
    try:
        assert body.sent_first.wait(TIMEOUT)
        _wait(lambda: uploads.in_use(upload_id), "the PATCH taking the session's lock")
        yield upload_id, body, answers
    finally:
        body.go_on.set()
        patch.join(TIMEOUT)


def test_upload_being_written_is_not_expired(hub: HubServer, user: tuple[str, str]) -> None:
    """Before: a ``PATCH`` whose bytes had not reached the file yet (buffered) left the
    session's file as old as before the request, and ``forkd hub gc`` run then deleted
    the session under it: the ``PATCH`` answered 202, the session was gone (404) and its
    bytes lost. Now a writing request keeps its session's file fresh from its start, and
    the sweep never removes a file a request holds (its lock): the session keeps all."""
    repo = f"{user[0]}/app"
    uploads = UploadArea(hub.data_dir / "uploads")
    with hub.client(user) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["Location"]
        with _patch_held(hub, c, location) as (upload_id, body, answers):
            # As a request that began near the idle timeout, its first bytes still in its
            # buffer, leaves it a while later: ten hours old as far as the file says.
            old = time.time() - 10 * 3600
            os.utime(uploads.path(upload_id), (old, old))
            hub.cli("gc", "--upload-ttl-hours", "1")
        assert answers and answers[0].status_code == 202, answers and answers[0].text
        status = c.get(location)
        assert status.status_code == 204, status.text
        assert status.headers["Range"] == "0-199"
        data = body.data
        r = c.put(f"{location}?digest={sha(data)}")
        assert r.status_code == 201, r.text


def test_patch_into_a_session_cancelled_meanwhile_is_refused(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """Before: a ``PATCH`` still streaming when its session was cancelled (``DELETE`` of
    the upload) wrote on into the deleted file and answered 202 with a ``Range``, for a
    session that was gone. Now a ``PATCH`` checks, once its bytes are written, that its
    file is still the session's: 404 BLOB_UPLOAD_UNKNOWN."""
    repo = f"{user[0]}/app"
    with hub.client(user) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["Location"]
        with _patch_held(hub, c, location) as (_, _, answers):
            with hub.client(user) as other:
                cancelled = other.delete(location)
            assert cancelled.status_code == 204, cancelled.text
        assert answers, "the PATCH never answered"
        assert answers[0].status_code == 404, answers[0].text
        assert answers[0].json()["errors"][0]["code"] == "BLOB_UPLOAD_UNKNOWN"
        assert c.get(location).status_code == 404


def _put_refused_when_cancelled(
    hub: Any,
    user: tuple[str, str],
    c: Any,
    location: str,
    data: bytes,
    held: threading.Event,
    go_on: threading.Event,
) -> None:
    """The closing PUT of ``data`` to ``location`` from another thread; once it is inside
    the step the test holds (``held`` set) the upload is cancelled on another connection,
    then the PUT goes on (``go_on``): it must answer 404 BLOB_UPLOAD_UNKNOWN."""
    answers: list[Any] = []
    put = threading.Thread(target=lambda: answers.append(c.put(f"{location}?digest={sha(data)}")))
    put.start()
    try:
        assert held.wait(TIMEOUT)
        with hub.client(user) as other:
            cancelled = other.delete(location)
        assert cancelled.status_code == 204, cancelled.text
    finally:
        go_on.set()
        put.join(TIMEOUT)
    assert answers, "the PUT never answered"
    assert answers[0].status_code == 404, answers[0].text
    assert answers[0].json()["errors"][0]["code"] == "BLOB_UPLOAD_UNKNOWN"


def test_put_of_a_session_cancelled_while_hashed_is_refused(
    hub: HubServer, user: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a closing ``PUT`` checked that its file was the session's, then hashed it
    (seconds for gigabytes), then linked it into the store by name: a ``DELETE`` of the
    upload meanwhile made the link a FileNotFoundError, a 500. Now the file is checked
    again after the hash and a link that finds it gone is 404 BLOB_UPLOAD_UNKNOWN."""
    from forkd.hub.oci import uploads as upload_routes

    hashing, go_on = threading.Event(), threading.Event()
    of_file = upload_routes.dg.of_file

    def held_hash(*args: Any, **kwargs: Any) -> str:
        hashing.set()
        assert go_on.wait(TIMEOUT)
        return of_file(*args, **kwargs)

    monkeypatch.setattr(upload_routes.dg, "of_file", held_hash)
    repo = f"{user[0]}/app"
    data = b"c" * 300
    with hub.client(user) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["Location"]
        assert c.patch(location, content=data).status_code == 202
        _put_refused_when_cancelled(hub, user, c, location, data, hashing, go_on)
        assert c.head(f"/v2/{repo}/blobs/{sha(data)}").status_code == 404


def test_s3_put_of_a_session_cancelled_while_read_is_refused(
    s3_hub: S3Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before (S3, shared sessions): a closing ``PUT`` reading the session's chunks from
    the bucket when a ``DELETE`` of the upload removed them failed on the missing object:
    a 500. Now it is 404 BLOB_UPLOAD_UNKNOWN, and nothing of the upload is left in the
    bucket (the fixture checks)."""
    from forkd.hub.shared_uploads import SharedUploads

    reading, go_on = threading.Event(), threading.Event()
    read = SharedUploads.read

    def held_read(self: SharedUploads, upload_id: str, names: Any) -> Iterator[bytes]:
        reading.set()
        assert go_on.wait(TIMEOUT)
        yield from read(self, upload_id, names)

    monkeypatch.setattr(SharedUploads, "read", held_read)
    user = s3_hub.add_user(unique_name("carol"))
    repo = f"{user[0]}/app"
    data = b"d" * 300
    with s3_hub.client(user) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["Location"]
        r = c.patch(location, content=data, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 202, r.text
        _put_refused_when_cancelled(s3_hub, user, c, location, data, reading, go_on)
