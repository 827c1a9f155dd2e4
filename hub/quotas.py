"""Per-namespace storage quotas.

Accounting: a namespace uses the sizes of the distinct blobs linked into its
repositories (``repository_blobs``): config and layer blobs that were uploaded or
mounted there, or written there by server-side compaction. A blob linked into
several repositories of one namespace counts once; a blob shared with another
namespace counts in each. Manifest bodies are not counted (they are bounded by
``manifest_max_bytes`` and are not linked blobs). Unlinking a blob (``DELETE
/v2/NAME/blobs/DIGEST``) or a GC sweep removing it gives the bytes back; deleting
tags or manifests alone does not, until GC removes the blobs they kept alive.

A link that would take the namespace past its quota is refused with ``DENIED``
before anything is stored (and checked again under the write lock when the blob is
linked, so concurrent uploads cannot overshoot together).
"""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd.errors import InvalidInput
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Namespace, Repository, RepositoryBlob

QUOTA_LOCK_CLASS = 0x71756F74  # "quot"


def usage(session: Session, namespace_id: int) -> int:
    """Bytes of the distinct blobs linked into the namespace's repositories."""
    linked = (
        select(RepositoryBlob.digest)
        .join(Repository, Repository.id == RepositoryBlob.repository_id)
        .where(Repository.namespace_id == namespace_id)
        .distinct()
        .subquery()
    )
    total = session.scalar(
        select(func.coalesce(func.sum(Blob.size), 0)).where(Blob.digest.in_(select(linked)))
    )
    return int(total or 0)


def _linked_in_namespace(session: Session, namespace_id: int, digest: str) -> bool:
    found = session.scalar(
        select(RepositoryBlob.digest)
        .join(Repository, Repository.id == RepositoryBlob.repository_id)
        .where(Repository.namespace_id == namespace_id, RepositoryBlob.digest == digest)
        .limit(1)
    )
    return found is not None


def check(session: Session, repository_id: int, digest: str, size: int) -> None:
    """Raise DENIED if linking ``digest`` (``size`` bytes) into the repository would take
    its namespace past its quota. A blob already in the namespace costs nothing. Sync ORM
    code: ``Database.read`` before an upload is stored, ``run_sync`` under the write lock."""
    row = (
        session.execute(
            select(Namespace.id, Namespace.name, Namespace.quota_bytes)
            .join(Repository, Repository.namespace_id == Namespace.id)
            .where(Repository.id == repository_id)
        )
    ).first()
    if row is None or row.quota_bytes is None:
        return
    if session.get_bind().dialect.name == "postgresql":
        # Writers share the GC lock on PostgreSQL: serialise this namespace's quota checks
        # (until commit) so concurrent uploads cannot overshoot together. SQLite writers
        # are serialised already (BEGIN IMMEDIATE). Two-int keys: apart from the GC lock's.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:cls, :ns)"), {"cls": QUOTA_LOCK_CLASS, "ns": row.id}
        )
    if _linked_in_namespace(session, row.id, digest):
        return
    used = usage(session, row.id)
    if used + size > row.quota_bytes:
        reason = (
            f"storage quota of namespace {row.name!r} exceeded: {used} of {row.quota_bytes} "
            f"bytes used, this blob needs {size} more"
        )
        raise RegistryError(Code.DENIED, reason, message=reason)


async def set_quota(session: AsyncSession, namespace: str, quota_bytes: int | None) -> None:
    """Set (or with None remove) a namespace's quota in bytes."""
    if quota_bytes is not None and quota_bytes < 0:
        raise InvalidInput("a quota is a number of bytes >= 0")
    ns = (await session.scalars(select(Namespace).where(Namespace.name == namespace))).first()
    if ns is None:
        raise InvalidInput(f"no such namespace {namespace!r}")
    ns.quota_bytes = quota_bytes


async def show(session: AsyncSession, namespace: str) -> tuple[int | None, int]:
    """(quota or None, bytes used)."""
    ns = (await session.scalars(select(Namespace).where(Namespace.name == namespace))).first()
    if ns is None:
        raise InvalidInput(f"no such namespace {namespace!r}")
    return ns.quota_bytes, await session.run_sync(usage, ns.id)
