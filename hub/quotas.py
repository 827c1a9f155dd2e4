"""Per-namespace storage quotas.

Accounting: a namespace uses the sizes of the distinct digests its repositories hold:
blobs linked into them (``repository_blobs``: config and layer blobs that were uploaded
or mounted there, or written there by server-side compaction) and manifest bodies
pushed to them (``manifests``). A digest held by several repositories of one namespace
counts once; one shared with another namespace counts in each. Unlinking a blob
(``DELETE /v2/NAME/blobs/DIGEST``), deleting a manifest (by digest, or by the retention
sweep) or a GC sweep removing blobs gives the bytes back; deleting tags alone does not,
until the manifests and then the blobs they kept alive go. What GC keeps is what this
counts: a blob a manifest of its repository references is not unlinked, nor a manifest an
index lists deleted (hub/oci/blobs.py, hub/oci/manifests.py), and GC's roots are only
digests their repository holds (hub/gc.py ``held_references``), so no bytes are given
back that GC then keeps.

A link or manifest that would take the namespace past its quota is refused with
``DENIED`` before anything is stored (and checked again under the write lock when the
blob is linked, so concurrent uploads cannot overshoot together).

Upload sessions: bytes held in a namespace's open (not yet expired) upload sessions
count against its quota while they are open, and so do the bytes a request writing one
has reserved: every ``PATCH``/``PUT``/monolithic ``POST`` reserves the room it fills
(``Upload.reserved_bytes``), under the namespace's lock, out of the quota left after the
stored usage and every other session's bytes or reservation (``NamespaceUploads.
in_flight``), so concurrent and unfinished uploads together cannot fill the disk past
the quota. A monolithic upload has a session row while its request runs. The session
count and size caps (``upload_sessions_max``, ``upload_max_bytes``) apply with or
without a quota (hub/oci/uploads.py).

The running total: a namespace with a quota keeps its usage in ``used_bytes``, computed
when the quota is set and kept by every change of its links (``charge`` when a blob is
linked or a manifest recorded, ``release`` when one is unlinked or deleted,
``release_swept`` when GC removes blobs), so a check costs a few indexed reads however
many blobs the namespace holds. Without a quota ``used_bytes`` is NULL and links cost no
accounting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, union, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd.errors import InvalidInput
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Manifest, Namespace, Repository, RepositoryBlob, Upload
from forkd.names import shown

QUOTA_LOCK_CLASS = 0x71756F74  # "quot"


def usage(session: Session, namespace_id: int) -> int:
    """Bytes of the distinct blobs and manifests the namespace's repositories hold."""
    linked = select(RepositoryBlob.digest).join(
        Repository, Repository.id == RepositoryBlob.repository_id
    )
    manifests = select(Manifest.digest).join(Repository, Repository.id == Manifest.repository_id)
    held = union(
        linked.where(Repository.namespace_id == namespace_id),
        manifests.where(Repository.namespace_id == namespace_id),
    ).subquery()
    total = session.scalar(
        select(func.coalesce(func.sum(Blob.size), 0)).where(Blob.digest.in_(select(held)))
    )
    return int(total or 0)


def _linked_in_namespace(session: Session, namespace_id: int, digest: str) -> bool:
    """Whether a repository of the namespace links ``digest`` or has it as a manifest."""
    for table in (RepositoryBlob, Manifest):
        found = session.scalar(
            select(table.digest)
            .join(Repository, Repository.id == table.repository_id)
            .where(Repository.namespace_id == namespace_id, table.digest == digest)
            .limit(1)
        )
        if found is not None:
            return True
    return False


def _namespace_of(session: Session, repository_id: int) -> Any:
    """(id, name, quota_bytes, used_bytes) of the repository's namespace."""
    return session.execute(
        select(Namespace.id, Namespace.name, Namespace.quota_bytes, Namespace.used_bytes)
        .join(Repository, Repository.namespace_id == Namespace.id)
        .where(Repository.id == repository_id)
    ).first()


def _serialise(session: Session, namespace_id: int) -> None:
    """On PostgreSQL, hold this namespace's quota lock until commit, so concurrent links
    cannot overshoot together or lose an update of the running total. SQLite writers are
    serialised already (BEGIN IMMEDIATE). Two-int keys: apart from the GC lock's."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(:cls, :ns)"),
            {"cls": QUOTA_LOCK_CLASS, "ns": namespace_id},
        )


def lock_namespace(session: Session, repository_id: int) -> None:
    """Take the repository's namespace's quota lock now, when a quota applies (``check``
    and ``release`` would take it later): a writer that will lock rows takes it first, in
    the order ``Database.repository_lock`` describes."""
    row = _namespace_of(session, repository_id)
    if row is not None and row.quota_bytes is not None:
        _serialise(session, row.id)


def check(session: Session, repository_id: int, digest: str, size: int) -> int:
    """Raise DENIED if linking ``digest`` (``size`` bytes) into the repository would take
    its namespace past its quota; else return the bytes it would add to the namespace's
    running total (0: no quota, or the blob is in the namespace already). Sync ORM code:
    a read before an upload is stored, or ``charge`` under the write lock."""
    row = _namespace_of(session, repository_id)
    if row is None or row.quota_bytes is None:
        return 0
    _serialise(session, row.id)
    row = _namespace_of(session, repository_id)  # as of now that this writer holds the lock
    if _linked_in_namespace(session, row.id, digest):
        return 0
    used = row.used_bytes if row.used_bytes is not None else usage(session, row.id)
    if used + size > row.quota_bytes:
        reason = (
            f"storage quota of namespace {shown(row.name)} exceeded: {used} of {row.quota_bytes} "
            f"bytes used, this blob needs {size} more"
        )
        raise RegistryError(Code.DENIED, reason, message=reason)
    return size


def charge(session: Session, repository_id: int, digest: str, size: int) -> None:
    """``check``, then count the blob or manifest in the running total; the caller links
    it (``link_blob``) or records the manifest (``register_manifest``) after this, in the
    same transaction."""
    added = check(session, repository_id, digest, size)
    if added:
        session.execute(
            update(Namespace)
            .where(
                Namespace.id
                == select(Repository.namespace_id)
                .where(Repository.id == repository_id)
                .scalar_subquery(),
                Namespace.used_bytes.is_not(None),
            )
            .values(used_bytes=Namespace.used_bytes + added)
        )


def release(session: Session, repository_id: int, digest: str) -> None:
    """After the blob's link (or the manifest) in the repository was deleted: give its
    bytes back to the namespace's running total unless the namespace still holds it."""
    row = _namespace_of(session, repository_id)
    if row is None or row.used_bytes is None:
        return
    _serialise(session, row.id)
    if _linked_in_namespace(session, row.id, digest):
        return
    size = session.scalar(select(Blob.size).where(Blob.digest == digest)) or 0
    session.execute(
        update(Namespace)
        .where(Namespace.id == row.id)
        .values(used_bytes=Namespace.used_bytes - size)
    )


def release_swept(session: Session, digests: list[str]) -> None:
    """Before GC deletes these blobs with all their links (under the GC lock): take their
    bytes off the running total of every namespace that links them."""
    pairs = (
        select(Repository.namespace_id, RepositoryBlob.digest)
        .join(Repository, Repository.id == RepositoryBlob.repository_id)
        .where(RepositoryBlob.digest.in_(digests))
        .distinct()
        .subquery()
    )
    freed = session.execute(
        select(pairs.c.namespace_id, func.sum(Blob.size))
        .join(Blob, Blob.digest == pairs.c.digest)
        .group_by(pairs.c.namespace_id)
    ).all()
    for namespace_id, size in freed:
        session.execute(
            update(Namespace)
            .where(Namespace.id == namespace_id, Namespace.used_bytes.is_not(None))
            .values(used_bytes=Namespace.used_bytes - int(size or 0))
        )


@dataclass(frozen=True)
class NamespaceUploads:
    """A namespace's open upload sessions and what its quota leaves for them."""

    namespace_id: int
    namespace: str
    quota_bytes: int | None
    # The room an upload may fill: quota minus stored usage, plus the size of the digest
    # it names when the namespace holds that blob already; None: no quota.
    quota_left: int | None
    used_bytes: int  # stored usage (0 without a quota: not computed)
    sessions: list[str]  # ids of its upload session rows (expired ones included)
    reserved: dict[str, int]  # reserved_bytes of the sessions a request is writing
    # id → (bytes recorded, last activity): what shared sessions (hub/shared_uploads.py)
    # hold; file-system sessions keep both in their files instead.
    recorded: dict[str, tuple[int, datetime]] = field(default_factory=dict)

    def in_flight(self, live: Mapping[str, int], besides: str) -> int:
        """Bytes the ``live`` sessions (id → file size) other than ``besides`` hold: each
        its file's size or the size its writing request reserved, the larger."""
        return sum(
            max(size, self.reserved.get(upload_id, 0))
            for upload_id, size in live.items()
            if upload_id != besides
        )


def uploads_of(session: Session, repository_id: int, digest: str | None = None) -> NamespaceUploads:
    """The repository's namespace's upload sessions and quota headroom (sync ORM code).
    Uploading ``digest``, a blob the namespace holds already, adds nothing to its usage
    once stored, so its upload may use the blob's size on top of what the quota leaves:
    room for one copy in flight, and no more. Its bytes are whatever the client sends
    until they are hashed, so they are never unbounded: the namespace's stored plus
    in-flight bytes stay within its quota plus the size of the held blob being sent."""
    row = _namespace_of(session, repository_id)
    sessions = session.execute(
        select(
            Upload.id,
            Upload.reserved_bytes,
            Upload.size,
            func.coalesce(Upload.touched_at, Upload.created_at),
        )
        .join(Repository, Repository.id == Upload.repository_id)
        .where(Repository.namespace_id == row.id)
    ).all()
    left, used = None, 0
    if row.quota_bytes is not None:
        used = row.used_bytes if row.used_bytes is not None else usage(session, row.id)
        left = row.quota_bytes - used
        if digest is not None and _linked_in_namespace(session, row.id, digest):
            left += session.scalar(select(Blob.size).where(Blob.digest == digest)) or 0
    return NamespaceUploads(
        row.id,
        row.name,
        row.quota_bytes,
        left,
        used,
        [upload_id for upload_id, *_ in sessions],
        {upload_id: reserved for upload_id, reserved, *_ in sessions if reserved},
        {upload_id: (size, at) for upload_id, _, size, at in sessions},
    )


def upload_sessions_locked(
    session: Session, repository_id: int, digest: str | None = None
) -> NamespaceUploads:
    """``uploads_of`` under the namespace's lock (PostgreSQL; SQLite writers are serial),
    for a writer that counts the sessions before it adds one, or reserves room."""
    row = _namespace_of(session, repository_id)
    _serialise(session, row.id)
    return uploads_of(session, repository_id, digest)


async def set_quota(session: AsyncSession, namespace: str, quota_bytes: int | None) -> None:
    """Set (or with None remove) a namespace's quota in bytes."""
    if quota_bytes is not None and quota_bytes < 0:
        raise InvalidInput("a quota is a number of bytes >= 0")
    ns = (await session.scalars(select(Namespace).where(Namespace.name == namespace))).first()
    if ns is None:
        raise InvalidInput(f"no such namespace {shown(namespace)}")
    await session.run_sync(_serialise, ns.id)
    ns.quota_bytes = quota_bytes
    # The running total starts here (the caller holds the write lock); none without a quota.
    ns.used_bytes = None if quota_bytes is None else await session.run_sync(usage, ns.id)


async def show(session: AsyncSession, namespace: str) -> tuple[int | None, int]:
    """(quota or None, bytes used)."""
    ns = (await session.scalars(select(Namespace).where(Namespace.name == namespace))).first()
    if ns is None:
        raise InvalidInput(f"no such namespace {shown(namespace)}")
    if ns.used_bytes is not None:
        return ns.quota_bytes, ns.used_bytes
    return ns.quota_bytes, await session.run_sync(usage, ns.id)
