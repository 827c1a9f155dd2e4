"""Garbage collection: remove blobs no manifest keeps alive, orphan files, stale uploads
and temporary files.

Mark: the roots are every manifest (its own bytes) and every digest a manifest
references (``manifest_references``: config, layers, child manifests, subject) that the
manifest's own repository holds (``held_references``). A blob a manifest references
cannot be unlinked from its repository, nor a manifest an index lists deleted, while
that manifest is there (hub/oci/blobs.py, hub/oci/manifests.py), so a root is always
something a namespace is charged for; a ``subject`` naming another repository's digest
pins nothing.
Sweep: a blob outside the roots is removed when it is older than the grace
period *and* no repository linked it within the grace period (a push refreshes
the link time), so a blob uploaded for a manifest that is not pushed yet survives.
Digests of either algorithm (sha256, sha512) are rows and store entries alike: the
store's ``digests()`` lists both, so orphan files of either are found.

Safety while the hub runs: the sweep holds the GC lock (SQLite: the write lock;
PostgreSQL: an exclusive advisory lock) from the query to the last file removed.
Manifest pushes take the shared side of it and check under it that the blob files
exist. A finished upload checks right after its link commits and stores the blob again
if a sweep removed an old copy before the link (the fresh link keeps it from the next
sweeps). So a push never ends with a manifest or link that points at a missing file.

Upload sessions idle past the upload TTL (files untouched) are dropped, and the blob
store's temporary files older than the grace period that no writer holds (a kill -9 in
the middle of a write leaves one). The hub does the same by itself every few minutes
(``expire_forever``, with ``upload_idle_timeout`` for both).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from itertools import islice
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import Select, delete, exists, func, select, union

from forkd.errors import NotFound
from forkd.hub import quotas
from forkd.hub.db import Database
from forkd.hub.models import Blob, Manifest, ManifestReference, RepositoryBlob, Upload, utcnow
from forkd.hub.shared_uploads import SharedUploads, expired_before
from forkd.hub.storage import UPLOAD_ID_RE, UploadArea
from forkd.store.blobs import BlobStore, FsBlobStore

BATCH = 500
log = logging.getLogger("forkd.hub")


@dataclass
class GcReport:
    dry_run: bool
    blobs: list[str] = field(default_factory=list)
    bytes: int = 0
    orphan_files: list[str] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)


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


def held_references() -> Select[Any]:
    """The digests manifests reference that their own repository holds (links: config
    and layers; a child or subject manifest is a root by its own row while it exists).
    A reference to a digest the repository does not hold (a ``subject`` may name any
    digest, in any repository) keeps nothing alive: what a namespace is charged for
    (hub/quotas.py) and what GC keeps for it are the same digests."""
    return (
        select(ManifestReference.digest)
        .join(Manifest, Manifest.id == ManifestReference.manifest_id)
        .join(
            RepositoryBlob,
            (RepositoryBlob.repository_id == Manifest.repository_id)
            & (RepositoryBlob.digest == ManifestReference.digest),
        )
    )


async def collect(
    db: Database,
    blobs: BlobStore,
    uploads: UploadArea,
    *,
    grace: timedelta,
    upload_ttl: timedelta,
    dry_run: bool = False,
    shared: SharedUploads | None = None,
) -> GcReport:
    report = GcReport(dry_run=dry_run)
    cutoff = utcnow() - grace
    cutoff_ts = time.time() - grace.total_seconds()
    # Every stored digest, listed before the GC lock is taken: the listing grows with what
    # accounts store (on S3, one request per 1,000 objects), and under the lock every push
    # and link on the hub waited for it. Only the decision needs the lock: under it, a
    # listed digest is an orphan if the database has no row for it and its file is older
    # than the grace (read again then); a file written after the listing is not judged.
    stored = await anyio.to_thread.run_sync(lambda: list(blobs.digests()))
    async with db.transaction() as session:
        await db.lock_for_gc(session)
        roots = union(select(Manifest.digest), held_references())
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
            for d in stored
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

    report.uploads = await expire_uploads(db, uploads, upload_ttl, dry_run=dry_run, shared=shared)
    report.temp_files = sweep_temp_files(blobs, grace, dry_run=dry_run)
    return report


async def expire_uploads(
    db: Database,
    uploads: UploadArea,
    idle: timedelta,
    *,
    dry_run: bool = False,
    shared: SharedUploads | None = None,
) -> list[str]:
    """Delete upload sessions whose bytes have not changed for ``idle`` (rows and files),
    rows whose file vanished, and stray files as old; return their ids. With ``shared``
    sessions (any replica's), see ``expire_shared``."""
    if shared is not None:
        return await expire_shared(db, uploads, shared, idle, dry_run=dry_run)
    stale_ts = time.time() - idle.total_seconds()
    # The files first, each judged and deleted under its lock (``remove_if_idle``): a
    # request writing one holds it, and its bytes may still be in its buffer, the file's
    # time of change behind them; then the rows of the files that are gone.
    found = _expired_files(uploads, stale_ts, dry_run=dry_run)
    async with db.transaction() as session:
        sessions = set((await session.scalars(select(Upload.id))).all())
        found += sorted(s for s in sessions if not (uploads.root / s).exists() and s not in found)
        if not dry_run:
            for batch in _batches(found):
                await session.execute(delete(Upload).where(Upload.id.in_(batch)))
    return found


def _expired_files(uploads: UploadArea, stale_ts: float, *, dry_run: bool) -> list[str]:
    """The upload area's files (sessions', or shared sessions' staging files) unchanged
    since ``stale_ts`` that no request holds, deleted unless ``dry_run``."""
    found: list[str] = []
    for name in sorted(os.listdir(uploads.root)):
        if not UPLOAD_ID_RE.match(name):
            continue
        try:
            expired = (uploads.root / name).stat().st_mtime < stale_ts
        except FileNotFoundError:  # finished or cancelled meanwhile
            continue
        if not expired:
            continue
        if dry_run:
            if not uploads.in_use(name):
                found.append(name)
        elif uploads.remove_if_idle(name, stale_ts):
            found.append(name)
    return found


async def expire_shared(
    db: Database,
    uploads: UploadArea,
    shared: SharedUploads,
    idle: timedelta,
    *,
    dry_run: bool = False,
) -> list[str]:
    """Shared sessions: rows no request added to for ``idle`` (the database's
    ``touched_at``, whichever replica wrote), with their chunks; chunk objects of sessions
    that are gone, as old; and this process's staging files as old. Never judged by this
    data directory's files: other replicas' sessions have none here."""
    oldest = expired_before(idle.total_seconds())
    async with db.transaction() as session:
        rows = (
            await session.execute(
                select(Upload.id, func.coalesce(Upload.touched_at, Upload.created_at))
            )
        ).all()
        known = {upload_id for upload_id, _ in rows}
        found = sorted(
            u for u, at in rows if (at if at.tzinfo else at.replace(tzinfo=UTC)) < oldest
        )
        if not dry_run:
            for batch in _batches(found):
                await session.execute(delete(Upload).where(Upload.id.in_(batch)))
    stray = await anyio.to_thread.run_sync(shared.stray_sessions, known, oldest)
    staging = _expired_files(uploads, oldest.timestamp(), dry_run=dry_run)
    if not dry_run:
        for upload_id in [*found, *stray]:
            await anyio.to_thread.run_sync(shared.delete_session, upload_id)
    return sorted({*found, *stray, *staging})


TEMP_MIN_AGE_S = 60.0  # temporary files younger than this are never swept


def sweep_temp_files(blobs: BlobStore, grace: timedelta, *, dry_run: bool = False) -> list[str]:
    """Delete the blob store's temporary files (``blobs/tmp``: writes a crash or kill cut
    short) older than ``grace``, unless a writer still holds one (its lock); return their
    names. Only the file-system backend has such files."""
    if not isinstance(blobs, FsBlobStore):
        return []
    # A writer creates its file, then locks it: never judge a file in that instant, even
    # with a grace of zero (a file that young is never a crash's leftover).
    cutoff = time.time() - max(grace.total_seconds(), TEMP_MIN_AGE_S)
    removed: list[str] = []
    for path in sorted(blobs.tmp.iterdir()):
        try:
            if not path.is_file() or path.stat().st_mtime >= cutoff or in_use(path):
                continue
        except FileNotFoundError:  # published or removed meanwhile
            continue
        removed.append(path.name)
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return removed


def in_use(path: Path) -> bool:
    """Whether a writer holds ``path``'s lock (``FsBlobStore.put_stream`` takes it)."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def sweep_interval(idle_timeout: float) -> float:
    """How often the hub looks for expired uploads: a quarter of the timeout, 1 s to 5 min."""
    return max(1.0, min(300.0, idle_timeout / 4))


async def expire_forever(
    db: Database,
    blobs: BlobStore,
    uploads: UploadArea,
    idle: float,
    shared: SharedUploads | None = None,
) -> None:
    """The hub's periodic work: expired upload sessions and stale temporary files, every
    ``sweep_interval``, until cancelled."""
    while True:
        await anyio.sleep(sweep_interval(idle))
        try:
            await expire_uploads(db, uploads, timedelta(seconds=idle), shared=shared)
            await anyio.to_thread.run_sync(sweep_temp_files, blobs, timedelta(seconds=idle))
        except Exception:  # a busy or restarting database: next time
            log.warning("could not expire upload sessions", exc_info=True)
