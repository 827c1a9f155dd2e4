"""Blobs: ``GET``/``HEAD``/``DELETE /v2/<name>/blobs/<digest>`` (with ``Range`` on reads).

A read's access check and blob lookup are one ``Database.read`` (inline on SQLite, like
a manifest GET), so a blob HEAD costs no aiosqlite round trip and no thread hop on the
file-system backend.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
from litestar import Response
from litestar.response import Stream
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from forkd.hub import quotas
from forkd.hub.accounts import Principal
from forkd.hub.authz import access
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Repository, RepositoryBlob
from forkd.hub.observability import StreamCut
from forkd.hub.oci.common import (
    STREAM_CHUNK,
    Ctx,
    RightsCheck,
    database_contention,
    parse_bound,
    parse_digest,
)
from forkd.hub.oci.manifests import referencing, still_referenced
from forkd.hub.services import Hub
from forkd.store.blobs import FsBlobStore

RANGE_RE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.ASCII)
OCTET = "application/octet-stream"


def _served_range(header: str) -> bool:
    """Whether a ``Range`` header asks for what this hub serves: one range of bytes. RFC
    9110 14.2: a range unit the server does not know MUST be ignored (``items=0-1``: the
    whole blob, 200, not a 416), and a server MAY ignore a Range header, as it does one
    asking for several ranges (no multipart answers). The unit is case-insensitive."""
    unit, sep, spec = header.strip().partition("=")
    return bool(sep) and unit.strip().lower() == "bytes" and "," not in spec


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` → inclusive (start, end); None if
    unusable (416). Per RFC 9110 14.1.1 a number past the blob's size, of any length,
    means "to the end" (an end, a suffix length) or is unsatisfiable (a start)."""
    _unit, _, spec = header.strip().partition("=")
    m = RANGE_RE.fullmatch(f"bytes={spec.strip()}")
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first = parse_bound(m.group(1), "range start") if m.group(1) else None
    last = parse_bound(m.group(2), "range end") if m.group(2) else None
    if first is None:
        assert last is not None  # one of the two is there
        if last == 0 or size == 0:
            return None
        return max(0, size - last), size - 1
    end = last if last is not None else size - 1
    if first >= size or end < first:
        return None
    return first, min(end, size - 1)


def _pull_lookup(
    session: Session, principal: Principal, name: str, digest: str
) -> tuple[Repository | None, frozenset[str], int | None]:
    """The access check's reads and the linked blob's size, in one read transaction (the
    manifest GET's fast path: inline on SQLite). The size is only looked up for a caller
    who may pull, and only used after ``Ctx.permit``."""
    repo, held = access(session, principal, name)
    if repo is None or "pull" not in held:
        return repo, held, None
    size = session.scalar(
        select(Blob.size)
        .join(RepositoryBlob, RepositoryBlob.digest == Blob.digest)
        .where(RepositoryBlob.repository_id == repo.id, RepositoryBlob.digest == digest)
    )
    return repo, held, size


async def _stored(hub: Hub, digest: str) -> bool:
    """Whether the store has the blob: a stat on the event loop's thread for local files,
    off it for other backends (with S3 a network round trip)."""
    if isinstance(hub.blobs, FsBlobStore):
        return hub.blobs.has(digest)
    return await anyio.to_thread.run_sync(hub.blobs.has, digest)


async def get(ctx: Ctx, digest: str, *, head: bool) -> Response[Any]:
    repo, held, size = await ctx.hub.db.read(_pull_lookup, ctx.caller.principal, ctx.name, digest)
    ctx.permit("pull", repo, held)
    digest = parse_digest(digest)
    ctx.known()
    if size is None or not await _stored(ctx.hub, digest):
        raise RegistryError(Code.BLOB_UNKNOWN, f"blob {digest} not in {ctx.name}")
    headers = {
        "Docker-Content-Digest": digest,
        "Accept-Ranges": "bytes",
        "X-Content-Type-Options": "nosniff",  # never rendered as what the bytes look like
    }
    start, end, status = 0, size - 1, 200
    range_header = ctx.request.headers.get("range")
    if range_header and _served_range(range_header):
        parsed = parse_range(range_header, size)
        if parsed is None:
            raise RegistryError(
                Code.SIZE_INVALID,
                f"range {range_header[:60]!r} not satisfiable for {size} bytes",
                status=416,
                headers={"Content-Range": f"bytes */{size}"},
            )
        start, end = parsed
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(end - start + 1)
    if head:
        return Response(b"", status_code=status, headers=headers, media_type=OCTET)
    return Stream(
        _read(ctx, digest, start, end - start + 1),
        status_code=status,
        headers=headers,
        media_type=OCTET,
    )


class DownloadCut(StreamCut):
    """A download's caller lost pull while it streamed (``RightsCheck``): the response's
    headers are sent, so no error document can follow; the connection is closed short of
    ``Content-Length``, which every client reads as a failed transfer."""


async def _read(ctx: Ctx, digest: str, offset: int, length: int) -> AsyncIterator[bytes]:
    """The blob's bytes from ``offset``, ``length`` of them, read off the event loop. Every
    ``RIGHTS_RECHECK_S`` the caller's pull is checked again (``RightsCheck``); once it is
    gone the download is cut (``DownloadCut``) and the audit log says so."""
    check = RightsCheck(ctx, "pull", "the download was cut")
    f = await anyio.to_thread.run_sync(ctx.hub.blobs.open, digest)
    try:
        await anyio.to_thread.run_sync(f.seek, offset)
        while length > 0:
            try:
                await check()
            except RegistryError as exc:
                ctx.audit("blob.pull", digest, "cut", reason=exc.detail)
                who = ctx.caller.principal.name
                raise DownloadCut(f"{ctx.name}@{digest} for {who}: {exc.detail}") from None
            block = await anyio.to_thread.run_sync(f.read, min(STREAM_CHUNK, length))
            if not block:
                return
            length -= len(block)
            ctx.hub.metrics.bytes_out.inc(len(block))
            yield block
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(f.close)


async def delete_blob(ctx: Ctx, digest: str) -> Response[object]:
    """Unlink a blob from the repository; the bytes stay for others until GC. Refused
    (400) while a manifest of the repository references it: the manifest would lose a
    blob its pulls need, and GC, which keeps what manifests reference, would keep the
    bytes the quota had been given back."""
    await ctx.allow("delete")
    digest = parse_digest(digest)
    hub = ctx.hub
    with database_contention():
        async with hub.db.transaction() as session:
            repo = await ctx.repository(session)
            # No manifest push referencing the blob commits between the check and the
            # unlink (hub/db.py ``repository_lock``).
            await hub.db.lock_for_write(session)
            await hub.db.lock_repository(session, repo.id)
            await session.run_sync(quotas.lock_namespace, repo.id)
            await ctx.still_async(session, "delete")
            linked = await session.scalar(
                select(RepositoryBlob.digest).where(
                    RepositoryBlob.repository_id == repo.id, RepositoryBlob.digest == digest
                )
            )
            if linked is None:
                raise RegistryError(Code.BLOB_UNKNOWN, f"blob {digest} not in {ctx.name}")
            named, total = await session.run_sync(referencing, repo.id, digest)
            if named:
                raise still_referenced(f"blob {digest}", named, total, ctx.name)
            await session.execute(
                delete(RepositoryBlob).where(
                    RepositoryBlob.repository_id == repo.id, RepositoryBlob.digest == digest
                )
            )
            await session.run_sync(quotas.release, repo.id, digest)
    ctx.audit("blob.delete", digest)
    return Response(b"", status_code=202)
