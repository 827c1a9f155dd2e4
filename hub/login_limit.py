"""The failed-login limiter: at most ``limit`` failed logins per client address and per
user name in ``window`` seconds, then 429 until the oldest failure leaves the window.

The failures are rows in the database (``login_failures``), so the worker processes of
``forkd hub serve --workers N`` (and hubs sharing one PostgreSQL) share one count: a
limiter per process would let a guesser try N times as often. Only logins that are not
in the verified-credential cache reach it, and they pay an argon2 verification anyway;
the check is one indexed read, a failure one small write that also drops expired rows.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from forkd.hub.db import Database
from forkd.hub.models import LoginFailure, utcnow

KEY_MAX = 80


def _key(key: str) -> str:
    return key[:KEY_MAX]


class LoginLimiter:
    def __init__(self, db: Database, limit: int, window: float) -> None:
        self.db = db
        self.limit = limit
        self.window = timedelta(seconds=window)

    async def retry_after(self, keys: list[str]) -> int:
        """Seconds until a login may be tried again (0: allowed now)."""
        return await self.db.read(self._retry_after, [_key(k) for k in keys])

    async def failed(self, keys: list[str]) -> None:
        await self.db.write(self._failed, [_key(k) for k in keys])

    def _retry_after(self, session: Session, keys: list[str]) -> int:
        now = utcnow()
        rows = session.execute(
            select(func.count(), func.min(LoginFailure.at))
            .where(LoginFailure.key.in_(keys), LoginFailure.at > now - self.window)
            .group_by(LoginFailure.key)
        ).all()
        wait = 0.0
        for count, oldest in rows:
            if count >= self.limit:
                if oldest.tzinfo is None:  # SQLite returns naive UTC
                    oldest = oldest.replace(tzinfo=now.tzinfo)
                wait = max(wait, (oldest + self.window - now).total_seconds())
        return int(wait) + 1 if wait > 0 else 0

    def _failed(self, session: Session, keys: list[str]) -> None:
        now = utcnow()
        session.execute(delete(LoginFailure).where(LoginFailure.at <= now - self.window))
        session.execute(insert(LoginFailure), [{"key": k, "at": now} for k in keys])
