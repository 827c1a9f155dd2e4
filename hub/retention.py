"""Retention rules: delete tags the configured rules no longer keep.

Each rule (``[[retention]]`` in the config file: ``repositories`` glob on full names,
``keep_last``, ``pulled_within_days``) applies to the repositories its glob matches; the
first matching rule wins. A tag is kept when it is among the ``keep_last`` most recently
pushed tags of its repository (push time: the tag's ``updated_at``), or when it was pulled
within ``pulled_within_days`` (``last_pulled_at``; a tag never pulled counts from its
push). With both set, either keeps it.

A tag that a kept tag depends on (its manifest is reached from a kept tag's manifest
through ``subject`` or an index's children, transitively) is always kept: a sweep never
breaks a chain someone still uses. Each deleted tag is audit-logged (``tag.delete``, actor
``(retention)``). A manifest left with no tag by the sweep, that no other manifest of the
repository names as subject or child, is deleted too (``manifest.delete``), so the
existing GC can then remove its blobs after the grace period.

The sweep runs in the background every ``retention_interval`` seconds when rules are
configured, and on demand with ``forkd hub gc --retention``.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fnmatch import fnmatchcase

import anyio
from sqlalchemy import delete, select

from forkd.audit import AuditLog
from forkd.hub import quotas
from forkd.hub.db import Database
from forkd.hub.models import Manifest, ManifestReference, Repository, Tag, utcnow
from forkd.hub.settings import RetentionRule

log = logging.getLogger("forkd.hub.retention")
ACTOR = "(retention)"
# Tags one transaction of a sweep deletes at most (then the write lock is let go, and the
# next namespace takes its turn).
SWEEP_CHUNK = 500


@dataclass
class RetentionReport:
    dry_run: bool = False
    tags: list[str] = field(default_factory=list)  # NAME:TAG deleted
    manifests: list[str] = field(default_factory=list)  # NAME@DIGEST deleted
    protected: list[str] = field(default_factory=list)  # NAME:TAG kept only as a parent


def rule_for(rules: Sequence[RetentionRule], repository: str) -> RetentionRule | None:
    return next((r for r in rules if fnmatchcase(repository, r.repositories)), None)


def _aware(ts: datetime) -> datetime:
    from datetime import UTC

    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def kept_by_rule(rule: RetentionRule, tags: Sequence[Tag], now: datetime) -> set[str]:
    """Names of the tags the rule itself keeps (before dependencies are added)."""
    kept: set[str] = set()
    if rule.keep_last is not None:
        newest = sorted(tags, key=lambda t: (_aware(t.updated_at), t.name), reverse=True)
        kept.update(t.name for t in newest[: rule.keep_last])
    if rule.pulled_within_days is not None:
        since = now - timedelta(days=rule.pulled_within_days)
        for t in tags:
            last = t.last_pulled_at or t.updated_at
            if _aware(last) >= since:
                kept.add(t.name)
    return kept


async def sweep(
    db: Database,
    rules: Sequence[RetentionRule],
    audit: AuditLog,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> RetentionReport:
    """One pass of the rules over every repository they match. Fair between namespaces
    and bounded per transaction: a repository's deletions are made SWEEP_CHUNK tags at a
    time, one transaction each, and namespaces take turns chunk by chunk, so a namespace
    of many repositories or tags neither holds the write lock for long nor makes the
    others' deletions wait for all of its own."""
    report = RetentionReport(dry_run=dry_run)
    if not rules:
        return report
    now = now or utcnow()
    queues: dict[str, deque[tuple[int, str, RetentionRule]]] = {}
    async with db.reading() as session:
        rows = await session.execute(
            select(Repository.id, Repository.name).order_by(Repository.name)
        )
        for repo_id, name in rows.all():
            rule = rule_for(rules, name)
            if rule is not None:
                queues.setdefault(name.split("/", 1)[0], deque()).append((repo_id, name, rule))
    turns = deque(queues.values())
    while turns:
        queue = turns.popleft()
        repo_id, name, rule = queue[0]
        if not await _sweep_repository(db, repo_id, name, rule, audit, report, now):
            queue.popleft()
        if queue:
            turns.append(queue)
    return report


async def _sweep_repository(
    db: Database,
    repo_id: int,
    name: str,
    rule: RetentionRule,
    audit: AuditLog,
    report: RetentionReport,
    now: datetime,
) -> bool:
    """Delete up to SWEEP_CHUNK of the tags the rule no longer keeps, and the manifests
    that leaves unneeded, in one transaction; True when more are left to delete."""
    async with db.transaction() as session:
        await db.lock_for_write(session)
        # No push or deletion in the repository commits while the sweep decides from the
        # references it reads here (an index pushed meanwhile naming a manifest it deletes).
        await db.lock_repository(session, repo_id)
        await session.run_sync(quotas.lock_namespace, repo_id)
        tags = list((await session.scalars(select(Tag).where(Tag.repository_id == repo_id))).all())
        if not tags:
            return False
        manifests = dict(
            (
                await session.execute(
                    select(Manifest.id, Manifest.digest).where(Manifest.repository_id == repo_id)
                )
            ).all()
        )
        by_digest = {d: i for i, d in manifests.items()}
        refs: dict[str, set[str]] = {}
        rows = await session.execute(
            select(Manifest.digest, ManifestReference.digest)
            .join(ManifestReference, ManifestReference.manifest_id == Manifest.id)
            .where(Manifest.repository_id == repo_id)
        )
        for parent, ref in rows.all():
            if ref in by_digest:  # subject or index child that is a manifest of this repository
                refs.setdefault(parent, set()).add(ref)

        kept = kept_by_rule(rule, tags, now)
        # Everything a kept tag's manifest depends on stays, transitively.
        needed: set[str] = set()
        todo = [t.manifest_digest for t in tags if t.name in kept]
        while todo:
            digest = todo.pop()
            for ref in refs.get(digest, ()):
                if ref not in needed:
                    needed.add(ref)
                    todo.append(ref)
        doomed = sorted(
            (t for t in tags if t.name not in kept and t.manifest_digest not in needed),
            key=lambda t: t.name,
        )
        more = not report.dry_run and len(doomed) > SWEEP_CHUNK
        if not more:  # the last turn: say once what stays only as a parent
            report.protected += [
                f"{name}:{t.name}"
                for t in tags
                if t.name not in kept and t.manifest_digest in needed
            ]
        if more:
            doomed = doomed[:SWEEP_CHUNK]
        if not doomed:
            return False
        for t in doomed:
            report.tags.append(f"{name}:{t.name}")
            if not report.dry_run:
                await session.execute(
                    delete(Tag).where(
                        Tag.repository_id == repo_id,
                        Tag.name == t.name,
                        Tag.manifest_digest == t.manifest_digest,
                    )
                )
                audit.record(
                    ACTOR,
                    "-",
                    "tag.delete",
                    f"{name}:{t.name}",
                    "ok",
                    digest=t.manifest_digest,
                    rule=rule.repositories,
                )
        if report.dry_run:
            return False
        # Manifests the sweep untagged, unless still tagged or depended on (to a fixpoint:
        # deleting a child can release its parent). Worked out in memory from what was
        # read above, in time linear in the repository's rows (the lock is held: nothing
        # else changes them): it re-read every tag of the repository for each manifest it
        # deleted, quadratic in rows under the write lock, for any pusher of many tags.
        doomed_names = {t.name for t in doomed}
        tagged = {t.manifest_digest for t in tags if t.name not in doomed_names}
        referrers: Counter[str] = Counter(ref for rs in refs.values() for ref in rs)
        candidates = {t.manifest_digest for t in doomed}
        ready = sorted(candidates)
        heapq.heapify(ready)
        while ready:
            digest = heapq.heappop(ready)
            if digest in tagged or referrers[digest] or digest not in by_digest:
                continue
            manifest_id = by_digest.pop(digest)
            for ref in refs.pop(digest, ()):
                referrers[ref] -= 1
                if not referrers[ref] and ref in candidates:
                    heapq.heappush(ready, ref)
            await session.execute(
                delete(ManifestReference).where(ManifestReference.manifest_id == manifest_id)
            )
            await session.execute(delete(Manifest).where(Manifest.id == manifest_id))
            await session.run_sync(quotas.release, repo_id, digest)
            report.manifests.append(f"{name}@{digest}")
            audit.record(
                ACTOR, "-", "manifest.delete", f"{name}@{digest}", "ok", rule=rule.repositories
            )
    return more


async def run(
    db: Database, rules: Sequence[RetentionRule], audit: AuditLog, interval: float
) -> None:
    """The background sweep: every ``interval`` seconds, until cancelled."""
    while True:
        await anyio.sleep(interval)
        try:
            report = await sweep(db, rules, audit)
            if report.tags:
                log.info(
                    "retention: deleted %d tags, %d manifests",
                    len(report.tags),
                    len(report.manifests),
                )
        except Exception:  # a busy or restarting database: try again next time
            log.warning("retention sweep failed", exc_info=True)
