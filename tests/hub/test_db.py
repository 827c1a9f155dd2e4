"""Database.read (inline on SQLite) and Database.write (whole transactions in a thread)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from forkd.hub import accounts
from forkd.hub.db import INLINE_BUSY_TIMEOUT_S, Database
from forkd.hub.models import Namespace, Repository, Upload


def _migrated(path: Path) -> str:
    url = f"sqlite+aiosqlite:///{path}"

    async def go() -> None:
        db = Database(url)
        try:
            await db.migrate()
        finally:
            await db.close()

    asyncio.run(go())
    return url


def test_a_locked_database_does_not_stall_the_event_loop(tmp_path: Path) -> None:
    """An inline read that meets a lock (here an outside connection in exclusive locking
    mode, as a backup tool may hold) gives up after INLINE_BUSY_TIMEOUT_S and waits in
    aiosqlite's thread: the event loop keeps running meanwhile, and the read completes."""
    url = _migrated(tmp_path / "hub.db")
    holder = sqlite3.connect(tmp_path / "hub.db", isolation_level=None, check_same_thread=False)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute(
        "INSERT INTO namespaces (name, kind, created_at) "
        "VALUES ('x', 'org', '2026-01-01 00:00:00.000000')"
    )
    # The lock is let go once the event loop has ticked TICKS times during the read: a
    # loop the read blocked never gets there (then the lock goes after 30 s and the count
    # below fails). It was let go after 0.6 s, and 15 of the ~55 ticks were asked for: a
    # loaded machine's loop could tick fewer.
    ticks_wanted = 20
    state: dict[str, int] = {"ticks": 0, "from": -1}

    def release() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if state["from"] >= 0 and state["ticks"] - state["from"] >= ticks_wanted:
                break
            time.sleep(0.005)
        holder.execute("COMMIT")
        holder.close()

    releaser = threading.Thread(target=release)

    async def go() -> tuple[object, int]:
        db = Database(url)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.01)
                state["ticks"] += 1

        task = asyncio.create_task(ticker())
        try:
            await asyncio.sleep(0.02)
            state["from"] = state["ticks"]
            releaser.start()
            found = await db.read(accounts.find_namespace, "x")
            return found, state["ticks"] - state["from"]
        finally:
            task.cancel()
            await db.close()

    found, ticks = asyncio.run(go())
    releaser.join(60)
    assert isinstance(found, Namespace) and found.name == "x"  # read after the commit
    # The loop ran while the read waited (blocked: none).
    assert INLINE_BUSY_TIMEOUT_S < 0.2 and ticks >= ticks_wanted, ticks


def test_concurrent_writes_all_commit_and_failures_roll_back(tmp_path: Path) -> None:
    url = _migrated(tmp_path / "hub.db")

    def add_repository(session: Session, name: str) -> None:
        ns = accounts.find_namespace(session, "acme")
        if ns is None:
            ns = Namespace(name="acme", kind="org")
            session.add(ns)
            session.flush()
        repo = Repository(name=name, namespace_id=ns.id, is_public=False)
        session.add(repo)
        session.flush()
        session.add(Upload(id=f"u-{name.rpartition('/')[2]}", repository_id=repo.id))

    def add_then_fail(session: Session) -> None:
        add_repository(session, "acme/doomed")
        raise RuntimeError("refused after the inserts")

    def count(session: Session) -> tuple[int, int]:
        repos = session.scalar(select(func.count()).select_from(Repository))
        uploads = session.scalar(select(func.count()).select_from(Upload))
        return int(repos or 0), int(uploads or 0)

    async def go() -> tuple[int, int]:
        db = Database(url)
        try:
            await db.write(add_repository, "acme/first")  # creates the namespace alone
            await asyncio.gather(*(db.write(add_repository, f"acme/r{i}") for i in range(30)))
            try:
                await db.write(add_then_fail)
            except RuntimeError:
                pass
            else:
                raise AssertionError("the failing write did not raise")
            return await db.read(count)
        finally:
            await db.close()

    assert asyncio.run(go()) == (31, 31)  # nothing of the failed transaction stayed
