"""Blob uploads: ``POST /v2/<name>/blobs/uploads/`` (session, monolithic with ``?digest=``,
or cross-repository mount with ``?mount=&from=``), ``PATCH``/``PUT``/``GET``/``DELETE
/v2/<name>/blobs/uploads/<id>``.

Session bytes go to the uploads area; ``PUT ?digest=`` moves them into the shared
blob store, which verifies the digest first: on a mismatch nothing is stored and
the session is dropped (DIGEST_INVALID). A ``PATCH`` must start where the bytes so
far end (416 otherwise); an interrupted ``PATCH`` keeps what arrived, and
``GET`` on the session tells the client where to resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from typing import BinaryIO

import anyio
from litestar import Response
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.hub import quotas
from forkd.hub.db import Database
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Repository, Upload
from forkd.hub.oci.common import STREAM_CHUNK, Ctx, link_blob, linked_blob_size, parse_digest
from forkd.hub.services import Hub
from forkd.hub.storage import validate_upload_id
from forkd.names import validate_name

CONTENT_RANGE_RE = re.compile(r"^(?:bytes[ =])?(\d+)-(\d+)(?:/\d+|/\*)?$")


def _range_header(size: int) -> str:
    return f"0-{max(size - 1, 0)}"


def _session_headers(ctx: Ctx, upload_id: str, size: int) -> dict[str, str]:
    return {
        "Location": ctx.url(f"blobs/uploads/{upload_id}"),
        "Range": _range_header(size),
        "Docker-Upload-UUID": upload_id,
    }


@contextlib.contextmanager
def _exclusive(f: BinaryIO) -> Iterator[None]:
    """One writer per session at a time; a second concurrent PATCH is refused, not merged."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RegistryError(
            Code.BLOB_UPLOAD_INVALID, "another request is writing this upload", status=416
        ) from None
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


async def _append(ctx: Ctx, upload_id: str) -> int:
    """Append the request body at the end of the session's bytes; return the new size."""
    content_range = ctx.request.headers.get("content-range")
    with ctx.hub.uploads.open_append(upload_id) as f, _exclusive(f):
        f.seek(0, 2)
        offset = f.tell()
        expected_len = None
        if content_range:
            m = CONTENT_RANGE_RE.match(content_range.strip())
            if not m or int(m.group(2)) < int(m.group(1)):
                raise RegistryError(
                    Code.BLOB_UPLOAD_INVALID,
                    f"malformed Content-Range {content_range[:60]!r}",
                    status=416,
                    headers=_session_headers(ctx, upload_id, offset),
                )
            start, end = int(m.group(1)), int(m.group(2))
            if start != offset:
                raise RegistryError(
                    Code.BLOB_UPLOAD_INVALID,
                    f"chunk starts at {start} but the upload has {offset} bytes",
                    status=416,
                    headers=_session_headers(ctx, upload_id, offset),
                )
            expected_len = end - start + 1
        written = 0
        try:
            async for chunk in ctx.request.stream():
                written += len(chunk)
                if expected_len is not None and written > expected_len:
                    f.truncate(offset)
                    raise RegistryError(
                        Code.SIZE_INVALID,
                        f"chunk is longer than its Content-Range ({expected_len} bytes)",
                        status=416,
                        headers=_session_headers(ctx, upload_id, offset),
                    )
                f.write(chunk)
                ctx.hub.metrics.bytes_in.inc(len(chunk))
        finally:
            f.flush()  # keep what arrived, even when the client went away: resumable
        if expected_len is not None and written != expected_len:
            f.truncate(offset)
            raise RegistryError(
                Code.SIZE_INVALID,
                f"chunk has {written} bytes, Content-Range said {expected_len}",
                status=416,
                headers=_session_headers(ctx, upload_id, offset),
            )
        return offset + written


async def _finish(ctx: Ctx, repo_id: int, upload_id: str, digest: str) -> Response[object]:
    """Verify and store the session's bytes as ``digest``, link it, drop the session."""
    hub = ctx.hub

    def store() -> int:
        """Verify and store; the size is the upload's (equal to the blob's once verified)."""
        with hub.uploads.open_read(upload_id) as f:
            if hub.blobs.has(digest):
                # The store would skip known content unread: check the client's bytes here.
                dg.check(digest, dg.of_file(f), f"upload {upload_id}")
            else:
                hub.blobs.put_stream(iter(lambda: f.read(STREAM_CHUNK), b""), expected=digest)
            return os.fstat(f.fileno()).st_size

    row_deleted = False
    try:
        try:
            # The quota first, so a refused upload stores nothing; link_blob checks again
            # under the write lock (concurrent uploads).
            # Not ``Database.read``: with a quota set this sums the namespace's blobs.
            async with hub.db.reading() as session:
                await session.run_sync(quotas.check, repo_id, digest, hub.uploads.size(upload_id))
        except RegistryError as exc:
            ctx.audit("blob.push", digest, "denied", reason=exc.detail)
            raise
        try:
            size = await anyio.to_thread.run_sync(store)
        except IntegrityError as exc:
            ctx.audit("blob.push", digest, "failed", reason="digest mismatch")
            raise RegistryError(Code.DIGEST_INVALID, str(exc)) from exc
        try:
            await hub.db.write(_link_upload, hub.db, repo_id, upload_id, digest, size)
            row_deleted = True
        except RegistryError as exc:
            if exc.code is Code.DENIED:  # over quota after all: keep nothing we stored
                ctx.audit("blob.push", digest, "denied", reason=exc.detail)
                await _discard_unrecorded(hub, digest)
            raise
        if not await anyio.to_thread.run_sync(hub.blobs.has, digest):
            # A GC sweep removed an old unreferenced copy that ``store`` found present,
            # before the link. The fresh link keeps the blob from the next sweeps (the
            # grace period), so storing it again now cannot race one.
            size = await anyio.to_thread.run_sync(store)
    finally:
        hub.uploads.remove(upload_id)
        if not row_deleted:
            async with hub.db.transaction() as session:
                await session.execute(delete(Upload).where(Upload.id == upload_id))
    ctx.audit("blob.push", digest, size=size)
    return Response(
        b"",
        status_code=201,
        headers={"Location": ctx.url(f"blobs/{digest}"), "Docker-Content-Digest": digest},
    )


def _link_upload(
    session: Session, db: Database, repo_id: int, upload_id: str, digest: str, size: int
) -> None:
    """Link the stored blob and drop the upload's session row: one write transaction."""
    link_blob(session, db, repo_id, digest, size)
    session.execute(delete(Upload).where(Upload.id == upload_id))


def _add_upload(session: Session, upload_id: str, repo_id: int) -> None:
    session.add(Upload(id=upload_id, repository_id=repo_id))


async def _discard_unrecorded(hub: Hub, digest: str) -> None:
    """Remove a blob file no ``blobs`` row records (one this request has just written)."""
    async with hub.db.transaction() as session:
        await hub.db.lock_for_write(session)
        if await session.get(Blob, digest) is None:
            with contextlib.suppress(NotFound):
                await anyio.to_thread.run_sync(hub.blobs.delete, digest)


async def _mount(ctx: Ctx, repo: Repository, digest: str, source: str) -> Response[object] | None:
    """Link ``digest`` from ``source`` if the caller may pull it there; None to fall back."""
    try:
        source = validate_name(source)
        await Ctx(ctx.hub, ctx.request, ctx.caller, source).allow("pull")
    except (InvalidInput, RegistryError):
        return None
    async with ctx.hub.db.transaction() as session:
        src = (await session.scalars(select(Repository).where(Repository.name == source))).first()
        size = await linked_blob_size(session, src.id, digest) if src else None
        if size is None or not await anyio.to_thread.run_sync(ctx.hub.blobs.has, digest):
            return None
        try:
            await session.run_sync(link_blob, ctx.hub.db, repo.id, digest, size)
        except RegistryError as exc:
            ctx.audit("blob.mount", digest, "denied", source=source, reason=exc.detail)
            raise
    ctx.audit("blob.mount", digest, source=source)
    return Response(
        b"",
        status_code=201,
        headers={"Location": ctx.url(f"blobs/{digest}"), "Docker-Content-Digest": digest},
    )


async def _new_session(ctx: Ctx, repo_id: int) -> str:
    upload_id = ctx.hub.uploads.new()
    await ctx.hub.db.write(_add_upload, upload_id, repo_id)
    return upload_id


async def start(ctx: Ctx) -> Response[object]:
    await ctx.allow("push")
    params = ctx.request.query_params
    repo = ctx.checked  # as read by allow; a write transaction only to create it
    if repo is None:
        async with ctx.hub.db.transaction() as session:
            repo = await ctx.repository_for_push(session)
    mount, source = params.get("mount"), params.get("from")
    if mount:
        digest = parse_digest(mount)
        if source:
            mounted = await _mount(ctx, repo, digest, source)
            if mounted is not None:
                return mounted
    digest_param = params.get("digest")
    if digest_param is not None:
        digest = parse_digest(digest_param)
        upload_id = ctx.hub.uploads.new()  # private to this request: no session row
        try:
            await _append(ctx, upload_id)
        except BaseException:
            ctx.hub.uploads.remove(upload_id)
            raise
        return await _finish(ctx, repo.id, upload_id, digest)
    upload_id = await _new_session(ctx, repo.id)
    return Response(b"", status_code=202, headers=_session_headers(ctx, upload_id, 0))


def _upload(session: Session, upload_id: str) -> Upload | None:
    return session.get(Upload, upload_id)


async def _session(ctx: Ctx, upload_id: str) -> int:
    """Validate the session id and that it belongs to this repository; return the repo id."""
    try:
        validate_upload_id(upload_id)
    except InvalidInput as exc:
        raise RegistryError(Code.BLOB_UPLOAD_UNKNOWN, str(exc)) from exc
    repo = ctx.known()
    upload = await ctx.hub.db.read(_upload, upload_id)
    if upload is None or upload.repository_id != repo.id:
        raise RegistryError(Code.BLOB_UPLOAD_UNKNOWN, f"upload {upload_id} not found")
    return repo.id


def _size(ctx: Ctx, upload_id: str) -> int:
    try:
        return ctx.hub.uploads.size(upload_id)
    except NotFound as exc:
        raise RegistryError(Code.BLOB_UPLOAD_UNKNOWN, str(exc)) from exc


async def patch(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    await _session(ctx, upload_id)
    size = await _append(ctx, upload_id)
    return Response(b"", status_code=202, headers=_session_headers(ctx, upload_id, size))


async def put(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    repo_id = await _session(ctx, upload_id)
    digest = parse_digest(ctx.request.query_params.get("digest", ""))
    await _append(ctx, upload_id)
    return await _finish(ctx, repo_id, upload_id, digest)


async def status(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    await _session(ctx, upload_id)
    size = _size(ctx, upload_id)
    return Response(b"", status_code=204, headers=_session_headers(ctx, upload_id, size))


async def cancel(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    await _session(ctx, upload_id)
    ctx.hub.uploads.remove(upload_id)
    async with ctx.hub.db.transaction() as session:
        await session.execute(delete(Upload).where(Upload.id == upload_id))
    ctx.audit("upload.cancel", upload_id)
    return Response(b"", status_code=204)
