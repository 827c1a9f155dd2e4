"""Garbage collection: remove blobs no manifest keeps alive, orphan files, stale uploads.

Mark: the roots are every manifest (its own bytes) and every digest a manifest
references (config, layers, child manifests, subject) in ``manifest_references``.
Sweep: a blob outside the roots is removed when it is older than the grace
period *and* no repository linked it within the grace period (a push refreshes
the link time), so a blob uploaded for a manifest that is not pushed yet survives.

Safety while the hub runs: the sweep holds the GC lock (SQLite: the write lock;
PostgreSQL: an exclusive advisory lock) from the query to the last file removed.
Manifest pushes take the shared side of it and check under it that the blob files
exist. A finished upload checks right after its link commits and stores the blob again
if a sweep removed an old copy before the link (the fresh link keeps it from the next
sweeps). So a push never ends with a manifest or link that points at a missing file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import islice

from sqlalchemy import delete, exists, select, union

from forkd.errors import NotFound
from forkd.hub import quotas
from forkd.hub.db import Database
from forkd.hub.models import Blob, Manifest, ManifestReference, RepositoryBlob, Upload, utcnow
from forkd.hub.storage import UPLOAD_ID_RE, UploadArea
from forkd.store.blobs import BlobStore

BATCH = 500


@dataclass
class GcReport:
    dry_run: bool
    blobs: list[str] = field(default_factory=list)
    bytes: int = 0
    orphan_files: list[str] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)


def _batches(items: list[str]) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(islice(it, BATCH)):
        yield batch


def _older_than(blobs: BlobStore, digest: str, ts: float) -> bool:
    """Whether a stored blob was written before ``ts``; a blob gone meanwhile is not."""
    try:
        return blobs.mtime(digest) < ts
    except NotFound:  # removed meanwhile
        return False


async def collect(
    db: Database,
    blobs: BlobStore,
    uploads: UploadArea,
    *,
    grace: timedelta,
    upload_ttl: timedelta,
    dry_run: bool = False,
) -> GcReport:
    report = GcReport(dry_run=dry_run)
    cutoff = utcnow() - grace
    cutoff_ts = time.time() - grace.total_seconds()
    async with db.transaction() as session:
        await db.lock_for_gc(session)
        roots = union(select(Manifest.digest), select(ManifestReference.digest))
        recently_linked = exists().where(
            RepositoryBlob.digest == Blob.digest, RepositoryBlob.created_at >= cutoff
        )
        rows = (
            await session.execute(
                select(Blob.digest, Blob.size).where(
                    Blob.created_at < cutoff, Blob.digest.not_in(roots), ~recently_linked
                )
            )
        ).all()
        report.blobs = [digest for digest, _ in rows]
        report.bytes = sum(size for _, size in rows)
        doomed = set(report.blobs)
        known = set((await session.scalars(select(Blob.digest))).all()) - doomed
        report.orphan_files = [
            d
            for d in blobs.digests()
            if d not in known and d not in doomed and _older_than(blobs, d, cutoff_ts)
        ]
        if not dry_run:
            for batch in _batches(report.blobs):
                await session.run_sync(quotas.release_swept, batch)
                await session.execute(
                    delete(RepositoryBlob).where(RepositoryBlob.digest.in_(batch))
                )
                await session.execute(delete(Blob).where(Blob.digest.in_(batch)))
            await session.flush()
            for digest in [*report.blobs, *report.orphan_files]:
                blobs.delete(digest)

        # Upload sessions with no activity (file untouched) for upload_ttl, and stray files.
        stale_ts = time.time() - upload_ttl.total_seconds()
        sessions = set((await session.scalars(select(Upload.id))).all())
        for name in sorted(os.listdir(uploads.root)):
            try:
                idle = (uploads.root / name).stat().st_mtime < stale_ts
            except FileNotFoundError:  # finished or cancelled meanwhile
                continue
            if UPLOAD_ID_RE.match(name) and idle:
                report.uploads.append(name)
        report.uploads += sorted(
            s for s in sessions if not (uploads.root / s).exists() and s not in report.uploads
        )
        if not dry_run:
            for batch in _batches(report.uploads):
                await session.execute(delete(Upload).where(Upload.id.in_(batch)))
            for upload_id in report.uploads:
                uploads.remove(upload_id)
    return report
