"""The failed-login limiter: at most ``limit`` failed logins per key (hub/auth.py counts
per client address) in ``window`` seconds, then 429 until the oldest failure leaves the window.

The failures are rows in the database (``login_failures``), so the worker processes of
``forkd hub serve --workers N`` and hub replicas sharing one PostgreSQL share one count:
a limiter per process would let a guesser try N times as often.

The count is never read and then acted on apart: ``attempt`` counts the key's failures
and, when there is room, records this attempt as one in the same transaction, under the
key's lock (PostgreSQL: a transaction-scoped advisory lock per key; SQLite: writers are
serial), before the password is checked. A login that then succeeds takes its row back
(``succeeded``). So ``limit`` guesses sent at once through every replica still get
``limit`` verifications, not one each. An attempt in flight carries a hash of the
credential it tries, and those in flight count once per credential (a client sending one
credential from many threads at once is not guessing); a failure (``failed``) drops the
hash, and every failure counts, a wrong password sent again too. The hash is an HMAC under
the hub's shared key (``rekey``), never a plain hash of the password: a row left behind
(a process killed while it checked a password) or a copy of the table is no fast way to
guess the password that argon2 protects.
Only logins that are not in the
verified-credential cache reach it, and they pay an argon2 verification anyway; an
attempt is one small write that also drops expired rows, a success one more.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from sqlalchemy import case, delete, func, select, text, update
from sqlalchemy.orm import Session

from forkd.hub.db import Database
from forkd.hub.models import LoginFailure, utcnow

KEY_MAX = 80
LOGIN_LOCK_CLASS = 0x6C6F6769  # "logi": apart from the GC and quota locks


def _key(key: str) -> str:
    return key[:KEY_MAX]


class LoginLimiter:
    def __init__(self, db: Database, limit: int, window: float) -> None:
        self.db = db
        self.limit = limit
        self.window = timedelta(seconds=window)
        # A placeholder until the hub's start puts its shared key in place (``rekey``).
        self._key = secrets.token_bytes(32)

    def rekey(self, key: bytes) -> None:
        """Tag credentials with ``key`` (the hub's shared key) from now on; a key of its
        own derived from it, so a tag is never a token's or a UI session's signature."""
        self._key = hashlib.sha256(b"forkd-login-limit\x00" + key).digest()

    def tag(self, credential: str) -> str:
        """What the database holds of ``credential`` while it is checked (64 hex)."""
        return hmac.new(self._key, credential.encode(), hashlib.sha256).hexdigest()

    async def attempt(self, keys: list[str], credential: str) -> tuple[int, list[int]]:
        """Start a login attempt with ``credential`` (user name and password tried, held
        only as an HMAC tag under the hub's key, ``tag``): (seconds
        until one may be tried again, 0 when it may go ahead; the ids of the rows that
        count it as a failure until ``succeeded``)."""
        keys = sorted({_key(k) for k in keys})
        return await self.db.write(self._attempt, keys, self.tag(credential))

    async def failed(self, attempt: list[int]) -> None:
        """The attempt's password was wrong: a failure of its own from now on."""
        if attempt:
            await self.db.write(self._fail, attempt)

    async def succeeded(self, attempt: list[int]) -> None:
        """The attempt's password was right: it is no failure."""
        if attempt:
            await self.db.write(self._forget, attempt)

    def _attempt(self, session: Session, keys: list[str], credential: str) -> tuple[int, list[int]]:
        if session.get_bind().dialect.name == "postgresql":
            for key in keys:  # sorted: two attempts never wait for each other in a cycle
                session.execute(
                    text("SELECT pg_advisory_xact_lock(:cls, hashtext(:key))"),
                    {"cls": LOGIN_LOCK_CLASS, "key": key},
                )
        now = utcnow()
        session.execute(delete(LoginFailure).where(LoginFailure.at <= now - self.window))
        wait = self._retry_after(session, keys, credential)
        if wait:
            return wait, []
        rows = [LoginFailure(key=k, at=now, attempt=credential) for k in keys]
        session.add_all(rows)
        session.flush()
        return 0, [row.id for row in rows]

    def _fail(self, session: Session, ids: list[int]) -> None:
        session.execute(update(LoginFailure).where(LoginFailure.id.in_(ids)).values(attempt=None))

    def _forget(self, session: Session, ids: list[int]) -> None:
        session.execute(delete(LoginFailure).where(LoginFailure.id.in_(ids)))

    def _retry_after(self, session: Session, keys: list[str], credential: str) -> int:
        """Seconds until an attempt with ``credential`` may go ahead (0: now): failures
        (no hash) count each, attempts in flight once per credential, and one whose
        credential is in flight already adds nothing."""
        now = utcnow()
        distinct = func.count(func.distinct(LoginFailure.attempt)) + func.sum(
            case((LoginFailure.attempt.is_(None), 1), else_=0)
        )
        known = func.max(case((LoginFailure.attempt == credential, 1), else_=0))
        rows = session.execute(
            select(distinct, func.min(LoginFailure.at), known)
            .where(LoginFailure.key.in_(keys), LoginFailure.at > now - self.window)
            .group_by(LoginFailure.key)
        ).all()
        wait = 0.0
        for count, oldest, counted in rows:
            if count - counted >= self.limit:
                if oldest.tzinfo is None:  # SQLite returns naive UTC
                    oldest = oldest.replace(tzinfo=now.tzinfo)
                wait = max(wait, (oldest + self.window - now).total_seconds())
        return int(wait) + 1 if wait > 0 else 0
