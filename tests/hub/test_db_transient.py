"""A transaction the database ends because of another one is a 503 to retry, not a 500.

Two requests that lock the same rows in opposite orders deadlock on PostgreSQL; it ends one
of them (SQLSTATE 40P01). The hub answered that request 500 ("Internal Server Error"),
telling the client neither that nothing was written nor that the same request would go
through now. It answers 503 with ``Retry-After`` (in the registry's error body on
``/v2/``); SQLite still locked after its busy wait is the same. Any other database error
stays a 500, naming nothing of its statement.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hub_server import ADMIN, HubServer
from hub_support import unique_name
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from forkd.hub import accounts, members
from forkd.hub.db import transient


@pytest.fixture
def pg_hub(tmp_path: Path, postgres_url: str) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"database_url": postgres_url}).start()
    try:
        yield server
    finally:
        server.stop()


def _other_transaction(url: str, holding: threading.Event, done: list[str]) -> None:
    """Another client of the database: takes lock 2, then waits for lock 1 (which the
    hub's request holds). Its deadlock check waits 10 s, the hub's 1 s: PostgreSQL ends
    the hub's transaction, not this one."""

    async def go() -> None:
        conn = await asyncpg.connect(url.replace("postgresql://", "postgres://"))
        try:
            await conn.execute("SET deadlock_timeout = '10s'")
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(7002)")
                holding.set()
                await conn.execute("SELECT pg_advisory_xact_lock(7001)")
            done.append("committed")
        finally:
            await conn.close()

    asyncio.run(go())


def test_a_deadlock_postgresql_breaks_is_a_503_to_retry(
    pg_hub: HubServer, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, someone = unique_name("org"), pg_hub.add_user(unique_name("dora"))
    with pg_hub.client(ADMIN) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
    holding, done = threading.Event(), []  # type: ignore[var-annotated]
    other = threading.Thread(target=_other_transaction, args=(postgres_url, holding, done))
    real = members.change_member
    calls = []

    async def deadlocking(session: AsyncSession, *args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:  # the first request meets the other transaction
            await session.execute(text("SELECT pg_advisory_xact_lock(7001)"))
            other.start()
            assert await asyncio.to_thread(holding.wait, 10)
            await asyncio.sleep(0.3)  # the other waits for lock 1 now
            await session.execute(text("SELECT pg_advisory_xact_lock(7002)"))
        await real(session, *args)

    monkeypatch.setattr(members, "change_member", deadlocking)
    url = f"/api/v1/orgs/{org}/members/{someone[0]}"
    with pg_hub.client(ADMIN) as c:
        started = time.monotonic()
        r = c.put(url, json={"role": "push"})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "send the request again" in r.json()["detail"]
        assert time.monotonic() - started < 10  # the hub's transaction was the one ended
        other.join(15)
        assert done == ["committed"]
        # Nothing of the first was written; the same request goes through now.
        members_now = {m["user"] for m in c.get(f"/api/v1/orgs/{org}/members").json()}
        assert someone[0] not in members_now
        assert c.put(url, json={"role": "push"}).status_code == 204
        members_now = {m["user"] for m in c.get(f"/api/v1/orgs/{org}/members").json()}
        assert someone[0] in members_now


def _raising(error: Exception) -> Callable[..., Any]:
    async def fail(*_args: Any, **_kwargs: Any) -> None:
        raise error

    return fail


def test_the_registry_says_so_in_its_own_error_body(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The login's database read fails. On ``/v2/`` the 503 is an OCI error body (code
    UNAVAILABLE); an error that is the hub's own is a 500 UNKNOWN naming nothing of the
    statement."""
    locked = OperationalError(
        "SELECT secret_column", {}, sqlite3.OperationalError("database is locked")
    )
    broken = IntegrityError(
        "INSERT secret_value", {}, sqlite3.IntegrityError("CHECK constraint failed")
    )
    user = hub.add_user(unique_name("vic"))
    for error, status, code in ((locked, 503, "UNAVAILABLE"), (broken, 500, "UNKNOWN")):
        monkeypatch.setattr(accounts, "authenticate_password", _raising(error))
        with hub.client(user) as c:
            r = c.get("/v2/")
        assert r.status_code == status, r.text
        assert r.json()["errors"][0]["code"] == code
        assert "secret" not in r.text
        assert ("retry-after" in r.headers) == (status == 503)


def test_which_database_errors_are_transient() -> None:
    class PgError(Exception):
        def __init__(self, code: str) -> None:
            self.sqlstate = code

    assert transient(OperationalError("s", {}, PgError("40P01")))  # deadlock broken
    assert transient(OperationalError("s", {}, PgError("40001")))  # serialization failure
    assert transient(OperationalError("s", {}, PgError("55P03")))  # lock not available
    assert not transient(OperationalError("s", {}, PgError("53100")))  # disk full
    assert not transient(IntegrityError("s", {}, PgError("23505")))
    assert transient(OperationalError("s", {}, sqlite3.OperationalError("database is locked")))
    assert not transient(OperationalError("s", {}, sqlite3.OperationalError("no such table: x")))
