"""Pull counts, gathered in memory and written in batches, so a manifest GET is read-only
(no write transaction per pull). Flushed every few seconds, before the catalog reads
counts (at most once a READ_FLUSH_S, one at a time: ``flush_for_read``), and at
shutdown; a crash loses at most the last interval's counts. A tag's ``last_pulled_at``
(retention rules' ``pulled_within_days``) is the time of the flush."""

from __future__ import annotations

import time
from collections import Counter

from sqlalchemy import update

from forkd.hub.db import Database
from forkd.hub.models import Repository, Tag, utcnow

FLUSH_INTERVAL_S = 5.0
# A listing read writes the counts at most this often (each is a write transaction, which
# waits for the write lock): a client alternating pulls and listings made every listing
# of everyone a write.
READ_FLUSH_S = 1.0


class PullCounter:
    """Counts per repository and, for pulls by tag, per (repository, tag)."""

    def __init__(self) -> None:
        self._pending: Counter[tuple[int, str | None]] = Counter()
        self._read_flushed = float("-inf")  # when a read last wrote the counts (monotonic)

    async def flush_for_read(self, db: Database) -> None:
        """Make the counts current for a listing, unless a read did so less than
        READ_FLUSH_S ago (then they are at most that old, from this process). The time
        is taken before the write, so concurrent reads write once, not once each."""
        now = time.monotonic()
        if not self._pending or now - self._read_flushed < READ_FLUSH_S:
            return
        self._read_flushed = now
        await self.flush(db)

    def record(self, repository_id: int, tag: str | None = None) -> None:
        self._pending[(repository_id, tag)] += 1

    async def flush(self, db: Database) -> None:
        pending, self._pending = self._pending, Counter()
        if not pending:
            return
        per_repo: Counter[int] = Counter()
        for (repo_id, _tag), n in pending.items():
            per_repo[repo_id] += n
        now = utcnow()
        try:
            async with db.transaction() as session:
                for repo_id, n in sorted(per_repo.items()):
                    await session.execute(
                        update(Repository)
                        .where(Repository.id == repo_id)
                        .values(pull_count=Repository.pull_count + n)
                    )
                for (repo_id, tag), n in sorted(pending.items(), key=str):
                    if tag is not None:
                        await session.execute(
                            update(Tag)
                            .where(Tag.repository_id == repo_id, Tag.name == tag)
                            .values(pull_count=Tag.pull_count + n, last_pulled_at=now)
                        )
        except BaseException:
            self._pending.update(pending)  # try again next time
            raise
