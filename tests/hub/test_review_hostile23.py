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
2. "Which manifests of repository R reference (or name as subject) D" was read through
   an index of every repository's rows for D, and a ``subject`` may name any digest:
   another namespace pushing many manifests naming your digests (or the empty config
   ``{}`` everyone references) made your deletions, referrers, lineage and pack pages
   scan all of them. Migration 0014 gives references their repository and indexes both
   reads by repository first.
3. A quota on a user's namespace bounded nothing: any signed-in user creates up to 20
   organisations, without a quota, and pushes into them. An organisation a user creates
   now starts with the quota of the user's own namespace.
4. One compaction per account at a time, so one account cannot take every place: but
   robots are accounts, and any signed-in user makes an organisation and robots in it.
   A robot now counts as the user who answers for it (``accounts.answerable_user``),
   and so it does for ``upload_sessions_per_user`` (each robot had 20 places more).
5. GC listed the whole blob store while it held the GC lock, which every push and link
   waits for: what accounts store (many small blobs, on S3 one LIST per 1,000) stalled
   every push of the hub for as long as the listing took. It lists first now.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from hub_support import (
    ADMIN,
    TIMEOUT,
    HubServer,
    browser,
    csrf_of,
    error_code,
    push_blob,
    sha,
)
from s3_hub_support import S3Hub
from sqlalchemy import create_engine, event
from sqlalchemy.orm import Session

from forkd.hub import chains
from forkd.hub.db import GC_LOCK, Database
from forkd.hub.gc import GcReport, collect
from forkd.hub.models import Manifest
from forkd.hub.oci import manifests
from forkd.hub.oci.referrers import referrers_query
from forkd.hub.services import Hub
from forkd.hub.settings import HubSettings
from forkd.pack import mediatypes as mt
from forkd.store.blobs import FsBlobStore


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
    _held_blob_upload_is_bounded(backend_hub)


def test_an_upload_naming_a_held_blob_is_bounded_with_shared_sessions(s3_hub: S3Hub) -> None:
    """The same with the S3 backend, whose sessions are rows and chunks in the bucket."""
    _held_blob_upload_is_bounded(s3_hub)


def _held_blob_upload_is_bounded(hub: HubServer) -> None:
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



ATTACKER_ROWS = 300


def _plans(tmp_path: Path, analyze: bool) -> dict[str, str]:
    """The SQLite query plans of every read of "the repository's manifests that reference
    or name D", run for a victim repository of a hub where another namespace pushed many
    manifests referencing and naming D: statement → its plan."""
    url = HubSettings(tmp_path).validated().database_url
    db = Database(url)
    try:
        asyncio.run(db.migrate())
    finally:
        asyncio.run(db.close())
    engine = create_engine("sqlite:///" + url.split(":///", 1)[1])
    d = "sha256:" + "d" * 64
    stamp = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO namespaces (id, name, kind, created_at) VALUES "
            f"(1, 'victim', 'org', '{stamp}'), (2, 'attacker', 'org', '{stamp}')"
        )
        conn.exec_driver_sql(
            "INSERT INTO repositories (id, name, namespace_id, is_public, created_at, "
            f"updated_at, pull_count) VALUES (1, 'victim/app', 1, 1, '{stamp}', '{stamp}', 0), "
            f"(2, 'attacker/app', 2, 0, '{stamp}', '{stamp}', 0)"
        )
        blobs = [(d, 2)] + [(f"sha256:{i:064x}", 2) for i in range(ATTACKER_ROWS + 1)]
        conn.exec_driver_sql(
            "INSERT INTO blobs (digest, size, created_at) VALUES (?, ?, ?)",
            [(digest, size, stamp) for digest, size in blobs],
        )
        rows = [(1, 1, d, None)] + [
            (i + 2, 2, f"sha256:{i:064x}", d) for i in range(ATTACKER_ROWS)
        ]
        conn.exec_driver_sql(
            "INSERT INTO manifests (id, repository_id, digest, media_type, artifact_type, "
            "subject_digest, size, created_at) VALUES (?, ?, ?, ?, ?, ?, 2, ?)",
            [(i, r, g, mt.OCI_MANIFEST, mt.ARTIFACT_TYPE, s, stamp) for i, r, g, s in rows],
        )
        conn.exec_driver_sql(
            "INSERT INTO manifest_references (manifest_id, repository_id, digest) VALUES "
            "(?, ?, ?)",
            [(i, r, s) for i, r, _, s in rows if s is not None],
        )
        if analyze:
            conn.exec_driver_sql("ANALYZE")
    statements: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, params))

    event.listen(engine, "before_cursor_execute", seen)
    with Session(engine) as session:
        victim = session.get(Manifest, 1)
        assert victim is not None
        assert manifests.referencing(session, 1, d) == ([], 0)
        assert manifests.referencing(session, 1, d, children_of=victim) == ([], 0)
        assert chains.descendants(session, 1, d, set()) == []
        manifests._refuse_snapshot_base(session, victim, "victim/app")  # no dependents
        assert session.execute(referrers_query(1, d, None, None)).all() == []
        assert session.execute(referrers_query(1, d, mt.ARTIFACT_TYPE, d)).all() == []
        # The attacker's own reads still find its rows.
        assert manifests.referencing(session, 2, d)[1] == ATTACKER_ROWS
        assert len(session.execute(referrers_query(2, d, None, None)).all()) == ATTACKER_ROWS
    event.remove(engine, "before_cursor_execute", seen)
    plans = {}
    with engine.connect() as conn:
        for statement, params in statements:
            if "manifest_references" not in statement and "subject_digest =" not in statement:
                continue
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params).all()
            plans[statement] = " | ".join(str(row[-1]) for row in rows)
    engine.dispose()
    return plans


@pytest.mark.parametrize("analyze", [False, True])
def test_reads_of_a_repositorys_referrers_never_scan_other_namespaces(
    tmp_path: Path, analyze: bool
) -> None:
    """A ``subject`` may name any digest and common digests (the empty config) are
    referenced everywhere: "which manifests of R reference or name D" used to be read
    through an index of every repository's references to D (``ix_manifest_references_
    digest``; ``ix_manifests_subject_digest``), so another namespace's many manifests
    made each such read of R (a blob's or manifest's deletion, referrers, the pack and
    lineage pages' descendants, a snapshot's dependents) scan all of them. Each is now
    read through an index that begins with the repository."""
    plans = _plans(tmp_path, analyze)
    assert len(plans) >= 5, plans
    for statement, plan in plans.items():
        assert "ix_manifest_references_digest" not in plan, (statement, plan)
        assert "ix_manifests_subject_digest" not in plan, (statement, plan)
        # The first table is read by the repository (what the planner prefers among
        # indexes that begin with it is its business: each holds the repository's rows).
        reads = [step for step in plan.split(" | ") if step.startswith(("SEARCH m", "SCAN m"))]
        assert reads and "(repository_id=?" in reads[0], (statement, plan)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0014_fills_each_references_repository(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """Upgrading to 0014 gives every reference its manifest's repository, on both
    backends, and the deletion checks read them: a blob of a manifest pushed before the
    upgrade is still refused deletion while that manifest references it."""
    given = request.getfixturevalue("postgres_url") if backend == "postgresql" else ""
    url = HubSettings(tmp_path, database_url=given).validated().database_url
    d, m1, m2 = ("sha256:" + c * 64 for c in "dab")
    stamp = "2026-01-01 00:00:00"

    async def go() -> list[tuple[int, int, str]]:
        db = Database(url)
        try:
            await db.migrate("0013")
            async with db.engine.begin() as conn:
                for sql in (
                    "INSERT INTO namespaces (id, name, kind, created_at) VALUES "
                    f"(1, 'a', 'org', '{stamp}'), (2, 'b', 'org', '{stamp}')",
                    "INSERT INTO repositories (id, name, namespace_id, is_public, created_at, "
                    f"updated_at, pull_count) VALUES (1, 'a/x', 1, false, '{stamp}', "
                    f"'{stamp}', 0), (2, 'b/y', 2, false, '{stamp}', '{stamp}', 0)",
                    "INSERT INTO blobs (digest, size, created_at) VALUES "
                    f"('{d}', 2, '{stamp}'), ('{m1}', 2, '{stamp}'), ('{m2}', 2, '{stamp}')",
                    "INSERT INTO manifests (id, repository_id, digest, media_type, size, "
                    f"created_at) VALUES (1, 1, '{m1}', 'm', 2, '{stamp}'), "
                    f"(2, 2, '{m2}', 'm', 2, '{stamp}')",
                    "INSERT INTO manifest_references (manifest_id, digest) VALUES "
                    f"(1, '{d}'), (2, '{d}')",
                ):
                    await conn.exec_driver_sql(sql)
            await db.migrate()
            async with db.engine.connect() as conn:
                rows = await conn.exec_driver_sql(
                    "SELECT manifest_id, repository_id, digest FROM manifest_references "
                    "ORDER BY manifest_id"
                )
                found = [(a, b, c) for a, b, c in rows.all()]
                named = await conn.run_sync(
                    lambda c: manifests.referencing(Session(bind=c), 1, d)
                )
                assert named == ([m1], 1)
            return found
        finally:
            await db.close()

    assert asyncio.run(go()) == [(1, 1, d), (2, 2, d)]


def test_an_organisation_a_user_creates_has_the_users_quota(backend_hub: HubServer) -> None:
    """Any signed-in user creates organisations and pushes into them: with a quota on the
    user's own namespace only, the same bytes went into an organisation of theirs without
    one. Now an organisation a user creates starts with the quota of the user's own
    namespace (a site admin's have none, and the operator may change either)."""
    hub = backend_hub
    who = hub.add_user("orgmaker")
    hub.cli("quota", "set", who[0], "1000")
    big = os.urandom(1500)
    with hub.client(who) as c:
        r = c.post(f"/v2/{who[0]}/app/blobs/uploads/", params={"digest": sha(big)}, content=big)
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert c.post("/api/v1/orgs", json={"name": "orgmaker-co"}).status_code == 201
        r = c.post("/v2/orgmaker-co/app/blobs/uploads/", params={"digest": sha(big)}, content=big)
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        push_blob(c, "orgmaker-co/app", os.urandom(1000))  # exactly up to it
    with hub.client(ADMIN) as c:
        r = c.get("/api/v1/namespaces/orgmaker-co/quota")
        assert r.json() == {"namespace": "orgmaker-co", "quota_bytes": 1000, "used_bytes": 1000}
        assert c.post("/api/v1/orgs", json={"name": "admin-co"}).status_code == 201
        r = c.get("/api/v1/namespaces/admin-co/quota")
        assert r.json()["quota_bytes"] is None
    free = hub.add_user("freemaker")  # no quota of its own: its organisations have none
    with hub.client(free) as c:
        assert c.post("/api/v1/orgs", json={"name": "freemaker-co"}).status_code == 201
        push_blob(c, "freemaker-co/app", big)


def test_an_accounts_robots_share_its_one_compaction_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compaction per account at a time keeps one account from taking every place
    (``compactions_max``, 2). But any signed-in user creates an organisation and robots
    in it, each an account of its own: alice's two robots took both places and every
    other account got 429. Now a robot counts as the user who answers for it (the
    creator of the organisation it was made for): alice's second robot is the 429 "one
    per account", and the other place stays bob's. The work is held
    (``_compactions_held``): the admission is what is tested."""
    from test_review_hostile6 import _compactions_held

    release, running = _compactions_held(monkeypatch)
    server = HubServer(tmp_path / "hub").start()
    try:
        alice, bob = server.add_user("alice"), server.add_user("bob")
        org = "alice-bots"
        with server.client(alice) as c:
            assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        robots = []
        with browser(server, *alice) as b:
            for name in (f"{org}+bot-one", f"{org}+bot-two"):  # ORG+NAME: review 25
                csrf = csrf_of(b.get("/-/settings/tokens").text)
                data = {"csrf": csrf, "namespace": org, "robot": name, "role": "push"}
                assert b.post("/-/settings/robots", data=data).status_code == 303
                robots.append((name, server.token(name, f"{org}:push")))

        def post(who: tuple[str, str], repo: str, tag: str) -> httpx.Response:
            with httpx.Client(base_url=server.url, auth=who, timeout=TIMEOUT) as c:
                return c.post(f"/api/v1/compact/{repo}", json={"tag": tag, "to": "flat"})

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(post, robots[0], f"{org}/app", "first")
            deadline = time.monotonic() + TIMEOUT
            while "first" not in running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert running == ["first"]
            again = post(robots[1], f"{org}/app", "second")
            assert again.status_code == 429 and "one per account" in again.text, again.text
            mine = post(alice, f"{alice[0]}/app", "alices")  # alice herself: the same place
            assert mine.status_code == 429 and "one per account" in mine.text, mine.text
            other = pool.submit(post, bob, f"{bob[0]}/app", "bobs")
            while "bobs" not in running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert running == ["first", "bobs"]  # the second place went to bob
            release.set()
            assert held.result(TIMEOUT).status_code == 404  # the held work's answer
            assert other.result(TIMEOUT).status_code == 404
        assert post(robots[1], f"{org}/app", "later").status_code == 404  # given back
    finally:
        release.set()
        server.stop()


def _gc_lock_free(settings: HubSettings) -> bool:
    """Whether a blob writer could take its side of the GC lock now (another connection:
    SQLite's write lock, PostgreSQL's shared advisory lock), without waiting."""
    if settings.database_url.startswith("sqlite"):
        conn = sqlite3.connect(settings.data_dir / "hub.db", timeout=0.2)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.rollback()
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()
    url = settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    got: list[bool] = []

    async def probe() -> None:
        conn = await asyncpg.connect(url)
        try:
            free = await conn.fetchval("SELECT pg_try_advisory_lock_shared($1)", GC_LOCK)
            if free:
                await conn.execute("SELECT pg_advisory_unlock_shared($1)", GC_LOCK)
            got.append(bool(free))
        finally:
            await conn.close()

    worker = threading.Thread(target=lambda: asyncio.run(probe()))
    worker.start()
    worker.join(TIMEOUT)
    assert got, "the probe did not answer"
    return got[0]


def test_gc_lists_the_blob_store_without_holding_every_push(backend_hub: HubServer) -> None:
    """GC listed every object of the blob store (on S3 one request per 1,000 objects, as
    many as accounts store) while holding the GC lock, which every push and link of the
    hub waits for. It lists first now, and judges under the lock only: an orphan file
    (no row, older than the grace) is still removed, a blob with its row kept."""
    hub = backend_hub
    who = hub.add_user("listing")
    with hub.client(who) as c:
        kept = push_blob(c, f"{who[0]}/app", os.urandom(100))
    settings = HubSettings(hub.data_dir, **hub.overrides).validated()
    orphan = FsBlobStore(hub.data_dir / "blobs").put_bytes(os.urandom(100))  # no row
    past = time.time() - 120
    os.utime(FsBlobStore(hub.data_dir / "blobs").path(orphan), (past, past))
    probes: list[bool] = []

    async def go() -> GcReport:
        built = Hub.build(settings)
        listing = built.blobs.digests

        def probed() -> Iterator[str]:
            probes.append(_gc_lock_free(settings))
            yield from listing()

        built.blobs.digests = probed  # type: ignore[method-assign]
        try:
            return await collect(
                built.db, built.blobs, built.uploads, grace=timedelta(minutes=1),
                upload_ttl=timedelta(hours=1),
            )  # fmt: skip
        finally:
            await built.close()

    report = asyncio.run(go())
    assert probes == [True]
    assert report.orphan_files == [orphan]
    store = FsBlobStore(hub.data_dir / "blobs")
    assert not store.has(orphan) and store.has(kept)


def test_a_users_robots_share_its_upload_sessions(tmp_path: Path) -> None:
    """``upload_sessions_per_user`` bounds what one user holds in unfinished uploads in
    every namespace together; but robots are accounts of their own, and any signed-in
    user makes an organisation and robots in it: each robot had as many places again.
    Now a user's count takes in the robots it answers for, and another user's is its own."""
    server = HubServer(tmp_path / "hub", {"upload_sessions_per_user": 2}).start()
    try:
        alice, bob = server.add_user("alice"), server.add_user("bob")
        org = "alice-uploads"
        with server.client(alice) as c:
            assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        robots = []
        with browser(server, *alice) as b:
            for name in (f"{org}+up-one", f"{org}+up-two"):  # ORG+NAME: review 25
                csrf = csrf_of(b.get("/-/settings/tokens").text)
                data = {"csrf": csrf, "namespace": org, "robot": name, "role": "push"}
                assert b.post("/-/settings/robots", data=data).status_code == 303
                robots.append((name, server.token(name, f"{org}:push")))
        with server.client(alice) as c:
            assert c.post(f"/v2/{alice[0]}/app/blobs/uploads/").status_code == 202
        with server.client(robots[0]) as c:
            assert c.post(f"/v2/{org}/app/blobs/uploads/").status_code == 202
        with server.client(robots[1]) as c:
            r = c.post(f"/v2/{org}/app/blobs/uploads/")
            assert r.status_code == 429 and "upload_sessions_per_user" in r.text, r.text
        with server.client(alice) as c:
            r = c.post(f"/v2/{alice[0]}/app/blobs/uploads/")
            assert r.status_code == 429 and "you have 2 open upload sessions" in r.text, r.text
        with server.client(bob) as c:  # another user's places are its own
            assert c.post(f"/v2/{bob[0]}/app/blobs/uploads/").status_code == 202
    finally:
        server.stop()
