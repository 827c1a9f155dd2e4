"""Alembic migrations on SQLite and on a real PostgreSQL; the models match the migrations."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from hub_support import ADMIN, HubServer, artifact
from sqlalchemy import Connection, inspect

from forkd.hub.db import Database, alembic_config
from forkd.hub.models import Base
from forkd.hub.settings import HubSettings

HEAD = ScriptDirectory.from_config(alembic_config()).get_current_head()
TABLES = {
    "users",
    "namespaces",
    "memberships",
    "api_tokens",
    "repositories",
    "blobs",
    "repository_blobs",
    "manifests",
    "manifest_references",
    "tags",
    "uploads",
}


def _roundtrip(url: str) -> None:
    async def go() -> None:
        db = Database(url)
        try:
            await db.migrate()
            assert await db.current_revision() == HEAD

            def check(conn: Connection) -> None:
                assert set(inspect(conn).get_table_names()) >= TABLES
                diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
                assert diff == [], diff

            async with db.engine.connect() as conn:
                await conn.run_sync(check)

            def downgrade(conn: Connection) -> None:
                command.downgrade(alembic_config(conn), "base")

            async with db.engine.begin() as conn:
                await conn.run_sync(downgrade)
            async with db.engine.connect() as conn:
                names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
            assert not names & TABLES
            await db.migrate()  # and up again
            assert await db.current_revision() == HEAD
        finally:
            await db.close()

    asyncio.run(go())


def test_migrations_on_sqlite(tmp_path: Path) -> None:
    _roundtrip(HubSettings(tmp_path).validated().database_url)


def test_migrations_on_postgresql(postgres_url: str) -> None:
    _roundtrip(HubSettings(Path("."), database_url=postgres_url).validated().database_url)


def test_hub_on_postgresql(postgres_url: str, tmp_path: Path) -> None:
    server = HubServer(tmp_path / "hub", {"database_url": postgres_url}).start()
    try:
        with server.client(auth=ADMIN) as c:
            digest, body = artifact(c, "library/pg", os.urandom(1000), tag="v1")
            assert c.get("/v2/library/pg/manifests/v1").content == body
            assert c.get("/v2/library/pg/tags/list").json()["tags"] == ["v1"]
            assert c.delete(f"/v2/library/pg/manifests/{digest}").status_code == 202
    finally:
        server.stop()


def test_0004_starts_running_totals_for_namespaces_with_quotas(tmp_path: Path) -> None:
    """Upgrading to 0004 computes used_bytes from the blobs already linked (each distinct
    blob once per namespace) for namespaces with a quota, and leaves the others NULL."""
    url = HubSettings(tmp_path).validated().database_url

    async def go() -> dict[str, int | None]:
        db = Database(url)
        try:
            await db.migrate("0003")
            async with db.engine.begin() as conn:
                for sql in (
                    "INSERT INTO namespaces (id, name, kind, created_at, quota_bytes) VALUES "
                    "(1, 'q', 'org', '2026-01-01', 5000), (2, 'free', 'org', '2026-01-01', NULL)",
                    "INSERT INTO repositories (id, name, namespace_id, is_public, created_at, "
                    "updated_at, pull_count) VALUES (1, 'q/a', 1, 0, '2026-01-01', "
                    "'2026-01-01', 0), (2, 'q/b', 1, 0, '2026-01-01', '2026-01-01', 0), "
                    "(3, 'free/a', 2, 0, '2026-01-01', '2026-01-01', 0)",
                    "INSERT INTO blobs (digest, size, created_at) VALUES "
                    "('sha256:" + "1" * 64 + "', 100, '2026-01-01'), "
                    "('sha256:" + "2" * 64 + "', 250, '2026-01-01')",
                    "INSERT INTO repository_blobs (repository_id, digest, created_at) VALUES "
                    "(1, 'sha256:" + "1" * 64 + "', '2026-01-01'), "
                    "(2, 'sha256:" + "1" * 64 + "', '2026-01-01'), "
                    "(2, 'sha256:" + "2" * 64 + "', '2026-01-01'), "
                    "(3, 'sha256:" + "2" * 64 + "', '2026-01-01')",
                ):
                    await conn.exec_driver_sql(sql)
            await db.migrate()
            async with db.engine.connect() as conn:
                rows = await conn.exec_driver_sql("SELECT name, used_bytes FROM namespaces")
                return {name: used for name, used in rows.all()}
        finally:
            await db.close()

    assert asyncio.run(go()) == {"q": 350, "free": None}


def test_0007_digest_columns_hold_sha512(postgres_url: str) -> None:
    """PostgreSQL enforces varchar lengths: a sha512 digest (135 characters) fits every
    digest column after 0007."""
    from sqlalchemy import text

    digest = "sha512:" + "ab" * 64

    url = HubSettings(Path("."), database_url=postgres_url).validated().database_url

    async def go() -> None:
        db = Database(url)
        try:
            await db.migrate()
            async with db.transaction() as session:
                await session.execute(
                    text("INSERT INTO blobs (digest, size, created_at) VALUES (:d, 1, now())"),
                    {"d": digest},
                )
                widths = (
                    await session.execute(
                        text(
                            "SELECT table_name, column_name, character_maximum_length "
                            "FROM information_schema.columns WHERE column_name IN "
                            "('digest', 'subject_digest', 'manifest_digest') "
                            "AND table_schema = 'public'"
                        )
                    )
                ).all()
            assert {(t, c): n for t, c, n in widths} == {
                ("blobs", "digest"): 135,
                ("repository_blobs", "digest"): 135,
                ("manifests", "digest"): 135,
                ("manifests", "subject_digest"): 135,
                ("manifest_references", "digest"): 135,
                ("tags", "manifest_digest"): 135,
            }
        finally:
            await db.close()

    asyncio.run(go())
