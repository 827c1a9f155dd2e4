"""Review of the replica-safe hub: what the login limiter keeps in the database of a
credential it is checking (a row any replica reads, and one a killed process leaves)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from sqlalchemy import select

from forkd.hub.db import Database
from forkd.hub.login_limit import LoginLimiter
from forkd.hub.models import LoginFailure
from forkd.hub.tokens import CredentialCache

KEY = b"k" * 32
KEYS = ["ip:192.0.2.7"]


def test_an_attempt_in_flight_keeps_no_plain_hash_of_the_password(tmp_path: Path) -> None:
    credential = CredentialCache.key("alice", "correct horse")
    plain = {credential, hashlib.sha256(b"correct horse").hexdigest()}

    async def go() -> list[str | None]:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'hub.db'}")
        try:
            await db.migrate()
            limiter = LoginLimiter(db, 5, 300.0)
            limiter.rekey(KEY)
            wait, ids = await limiter.attempt(KEYS, credential)
            assert wait == 0 and ids
            async with db.reading() as session:
                return list(await session.scalars(select(LoginFailure.attempt)))
        finally:
            await db.close()

    stored = asyncio.run(go())
    assert len(stored) == 1 and stored[0] is not None
    assert stored[0] not in plain  # an HMAC under the hub's key, not sha256(user, password)


def test_replicas_with_one_key_count_one_credential_in_flight_once(tmp_path: Path) -> None:
    """Two limiters on one database (two replicas) with the hub's shared key: the same
    credential in flight on both counts once; another one is a guess of its own."""

    async def go() -> tuple[int, int, int]:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'hub.db'}")
        try:
            await db.migrate()
            first, second = LoginLimiter(db, 1, 300.0), LoginLimiter(db, 1, 300.0)
            first.rekey(KEY)
            second.rekey(KEY)
            same = CredentialCache.key("alice", "pw")
            other = CredentialCache.key("alice", "guess")
            a, _ = await first.attempt(KEYS, same)
            b, _ = await second.attempt(KEYS, same)
            c, _ = await second.attempt(KEYS, other)
            return a, b, c
        finally:
            await db.close()

    a, b, c = asyncio.run(go())
    assert (a, b) == (0, 0)
    assert c > 0
