"""Blobs: ``GET``/``HEAD``/``DELETE /v2/<name>/blobs/<digest>`` (with ``Range`` on reads)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anyio
from litestar import Response
from litestar.response import Stream
from sqlalchemy import delete

from forkd.hub import quotas
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import RepositoryBlob
from forkd.hub.oci.common import STREAM_CHUNK, Ctx, linked_blob_size, parse_digest

RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
OCTET = "application/octet-stream"


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` → inclusive (start, end); None if unusable."""
    m = RANGE_RE.fullmatch(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):
        length = int(m.group(2))
        if length == 0 or size == 0:
            return None
        return max(0, size - length), size - 1
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


async def get(ctx: Ctx, digest: str, *, head: bool) -> Response[Any]:
    await ctx.allow("pull")
    digest = parse_digest(digest)
    async with ctx.hub.db.reading() as session:
        repo = await ctx.repository(session)
        size = await linked_blob_size(session, repo.id, digest)
    # Off the event loop: with the S3 backend this is a network round trip.
    if size is None or not await anyio.to_thread.run_sync(ctx.hub.blobs.has, digest):
        raise RegistryError(Code.BLOB_UNKNOWN, f"blob {digest} not in {ctx.name}")
    headers = {"Docker-Content-Digest": digest, "Accept-Ranges": "bytes"}
    start, end, status = 0, size - 1, 200
    range_header = ctx.request.headers.get("range")
    if range_header:
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


def _read(ctx: Ctx, digest: str, offset: int, length: int) -> Iterator[bytes]:
    with ctx.hub.blobs.open(digest) as f:
        f.seek(offset)
        while length > 0:
            block = f.read(min(STREAM_CHUNK, length))
            if not block:
                return
            length -= len(block)
            ctx.hub.metrics.bytes_out.inc(len(block))
            yield block


async def delete_blob(ctx: Ctx, digest: str) -> Response[object]:
    """Unlink a blob from the repository; the bytes stay for others until GC."""
    await ctx.allow("delete")
    digest = parse_digest(digest)
    async with ctx.hub.db.transaction() as session:
        repo = await ctx.repository(session)
        result = await session.execute(
            delete(RepositoryBlob).where(
                RepositoryBlob.repository_id == repo.id, RepositoryBlob.digest == digest
            )
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise RegistryError(Code.BLOB_UNKNOWN, f"blob {digest} not in {ctx.name}")
        await session.run_sync(quotas.release, repo.id, digest)
    ctx.audit("blob.delete", digest)
    return Response(b"", status_code=202)
