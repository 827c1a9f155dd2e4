"""Pull counts, gathered in memory and written in batches, so a manifest GET is read-only
(no write transaction per pull). Flushed every few seconds, before the catalog reads
counts, and at shutdown; a crash loses at most the last interval's counts."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import update

from forkd.hub.db import Database
from forkd.hub.models import Repository

FLUSH_INTERVAL_S = 5.0


class PullCounter:
    def __init__(self) -> None:
        self._pending: Counter[int] = Counter()

    def record(self, repository_id: int) -> None:
        self._pending[repository_id] += 1

    async def flush(self, db: Database) -> None:
        pending, self._pending = self._pending, Counter()
        if not pending:
            return
        try:
            async with db.transaction() as session:
                for repo_id, n in sorted(pending.items()):
                    await session.execute(
                        update(Repository)
                        .where(Repository.id == repo_id)
                        .values(pull_count=Repository.pull_count + n)
                    )
        except BaseException:
            self._pending.update(pending)  # try again next time
            raise
