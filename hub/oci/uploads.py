"""Blob uploads: ``POST /v2/<name>/blobs/uploads/`` (session, monolithic with ``?digest=``,
or cross-repository mount with ``?mount=&from=``), ``PATCH``/``PUT``/``GET``/``DELETE
/v2/<name>/blobs/uploads/<id>``.

Session bytes go to the uploads area; ``PUT ?digest=`` moves them into the shared
blob store after checking the digest: on a mismatch nothing is stored and the session is
dropped (DIGEST_INVALID). With the filesystem backend the session's file itself becomes
the blob (a hard link, no copy), hashed as it was received when one request wrote all of
it (a monolithic upload), else read once to hash it. The closing request holds the
session's lock from its first byte to the link (a ``PATCH`` meanwhile gets 416 and the
session stays whole), and a writer that finds its file published refuses to append to it.
Other backends stream the file to the store, which verifies it. A ``PATCH`` must start
where the bytes so far end (416 otherwise); an interrupted ``PATCH`` keeps what arrived,
and ``GET`` on the session tells the client where to resume.

Limits (hub/settings.py): a namespace has at most ``upload_sessions_max`` open sessions
and a user ``upload_sessions_per_user`` in all namespaces (429 beyond; a monolithic
upload holds one while its request runs; at a limit, empty sessions idle for
``EMPTY_SESSION_GRACE`` that no request writes are reclaimed first), a session (or
monolithic upload) holds at most ``upload_max_bytes`` (413 beyond), and bytes in open
sessions, or reserved by the requests writing them (``_Room``), count against the
namespace's quota while they are open (hub/quotas.py). A session with no
``PATCH``/``PUT`` for ``upload_idle_timeout`` seconds has expired: it answers
``BLOB_UPLOAD_UNKNOWN`` and its file is deleted, by that request, the hub's periodic
sweep or ``forkd hub gc`` (hub/gc.py). A session whose data file vanished answers
``BLOB_UPLOAD_UNKNOWN`` too.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import BinaryIO

import anyio
from litestar import Response
from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.hub import accounts, authz, quotas, shared_uploads
from forkd.hub.auth import still_permitted
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Repository, Upload, User
from forkd.hub.oci.common import (
    STREAM_CHUNK,
    Ctx,
    RightsCheck,
    checked_body,
    declared_length,
    in_chunks,
    link_blob,
    linked_blob_size,
    parse_count,
    parse_digest,
)
from forkd.hub.quotas import NamespaceUploads
from forkd.hub.services import Hub
from forkd.hub.shared_uploads import (
    CHUNK_MAX,
    EMPTY_SESSION_GRACE,
    chunk_keys,
    commit_chunk,
    expired_before,
    idle_seconds,
    touch,
    touch_every,
)
from forkd.hub.storage import validate_upload_id
from forkd.names import shown, validate_name
from forkd.store.blobs import FsBlobStore

CONTENT_RANGE_RE = re.compile(r"(?:bytes[ =])?([0-9]+)-([0-9]+)(?:/([0-9]+)|/\*)?", re.ASCII)
CHALLENGE_SCOPE_RE = re.compile(r'scope="([^"]*)"')
# How far ahead of the bytes received an upload without Content-Length reserves quota.
RESERVE_STEP = 16 << 20
UPLOAD_USER_LOCK_CLASS = 0x75706C64  # "upld": serialises one user's session creations


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


def _unknown(upload_id: str, why: str) -> RegistryError:
    return RegistryError(
        Code.BLOB_UPLOAD_UNKNOWN,
        f"upload {upload_id} {why}; start a new upload (POST /v2/NAME/blobs/uploads/)",
    )


def _open_append(hub: Hub, upload_id: str) -> BinaryIO:
    """The file this request appends to: the session's own, or with shared sessions this
    process's staging file for it (made on first use: another process may have begun it)."""
    if hub.shared is not None:
        return hub.uploads.open_staging(upload_id)
    try:
        return hub.uploads.open_append(upload_id)
    except NotFound:
        raise _unknown(upload_id, "has lost its data") from None


async def _recorded(hub: Hub, upload_id: str, f: BinaryIO) -> int:
    """Under the file's lock, before a request appends: the session's bytes that are not
    in ``f``. With shared sessions, the bytes its recorded chunks hold (``f``, the staging
    file, is emptied: what a request cut short left there was never recorded); else 0."""
    if hub.shared is None:
        return 0
    f.truncate(0)
    upload = await hub.db.read(_upload, upload_id)
    if upload is None:
        raise _unknown(upload_id, "is gone (finished or cancelled meanwhile)")
    return upload.size


async def _commit(hub: Hub, upload_id: str, offset: int, written: int, f: BinaryIO) -> None:
    """With shared sessions: record the ``written`` bytes of the staging file ``f`` as the
    chunk at ``offset`` (an object in the bucket, then its row); 416 when another request
    recorded one there first. The staging file is emptied whatever happens."""
    shared = hub.shared
    if shared is None:
        return
    try:
        key = ""
        if written:
            key = await anyio.to_thread.run_sync(shared.put_chunk, upload_id, offset, f)
        recorded = False
        try:
            recorded = await hub.db.write(commit_chunk, upload_id, offset, written, key)
        finally:
            if not recorded and key:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(shared.delete_chunks, upload_id, [key])
        if not recorded:
            upload = await hub.db.read(_upload, upload_id)
            if upload is None:
                raise _unknown(upload_id, "is gone (finished or cancelled meanwhile)")
            raise RegistryError(
                Code.BLOB_UPLOAD_INVALID,
                f"another request wrote this upload at byte {offset} meanwhile; it now has "
                f"{upload.size} bytes: resume from there (GET the upload for its Range)",
                status=416,
                headers={"Range": _range_header(upload.size)},
            )
    finally:
        f.truncate(0)


def _live(hub: Hub, held: NamespaceUploads) -> dict[str, int]:
    """Sizes of the namespace's sessions that have not expired (id → bytes)."""
    return _live_of(hub, held.sessions, held.recorded)


def _live_of(
    hub: Hub, sessions: list[str], recorded: dict[str, tuple[int, datetime]]
) -> dict[str, int]:
    """Sizes of those ``sessions`` that have not expired (id → bytes); ``recorded``:
    their rows' (size, last activity), what shared sessions go by."""
    timeout = hub.settings.upload_idle_timeout
    if hub.shared is None:
        return hub.uploads.live_sizes(sessions, timeout)
    oldest = expired_before(timeout)
    return {upload_id: size for upload_id, (size, at) in recorded.items() if _aware(at) >= oldest}


def _aware(at: datetime) -> datetime:
    """``at`` with its time zone (SQLite returns naive UTC)."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


async def _remove_bytes(hub: Hub, upload_id: str, chunks: _Chunks | None = None) -> None:
    """Delete a session's bytes: its file (or staging file) and its chunks in the bucket:
    ``chunks`` when the caller read them (no listing; an object no row recorded is left to
    GC's sweep of sessions that are gone), else every object under the session's prefix."""
    hub.uploads.remove(upload_id)
    shared = hub.shared
    if shared is None or (chunks is not None and not chunks.keys):
        return
    with anyio.CancelScope(shield=True):
        if chunks is None:
            await anyio.to_thread.run_sync(shared.delete_session, upload_id)
        else:
            await anyio.to_thread.run_sync(shared.delete_chunks, upload_id, list(chunks.keys))


def _current(hub: Hub, upload_id: str, f: BinaryIO) -> None:
    """Under the session's lock: the file is still the session's (not published)."""
    try:
        hub.uploads.check_current(upload_id, f)
    except NotFound:
        raise _unknown(upload_id, "has lost its data") from None


@dataclass(frozen=True)
class _Received:
    """What one request appended: the session file's size after it, whether a quota
    applied (``_Room``), and the file's digest when this request wrote all of it."""

    size: int
    quota: bool
    digest: str | None = None


class _Room:
    """The room one request may fill in an upload: up to ``upload_max_bytes`` per upload
    (413 beyond) and, under a quota, only bytes it has reserved (403 DENIED when the quota
    cannot give them). A reservation (``Upload.reserved_bytes``: the size the file may
    reach) is taken under the namespace's write lock before the bytes are written, out of
    the quota left after stored usage and every other live session's bytes or
    reservation, and given back when the request ends however it ends. When ``digest``
    names a blob the namespace holds already, the room is the blob's size more
    (``quotas.uploads_of``): the bytes cost nothing once stored, but until they are
    hashed they are any bytes, so they are bounded like every upload's."""

    def __init__(
        self,
        ctx: Ctx,
        repo_id: int,
        upload_id: str,
        offset: int,
        digest: str | None,
        quota: bool | None = None,
        chunk_max: int | None = None,
    ):
        self.ctx, self.repo_id, self.upload_id = ctx, repo_id, upload_id
        self.offset, self.digest = offset, digest
        self.cap = ctx.hub.settings.upload_max_bytes
        self.chunk_max = chunk_max  # the most this request may add (None: up to ``cap``)
        # Whether a quota applies: given by the caller that read it in this request (the
        # session's creation), else read by ``open``.
        self.quota = bool(quota)
        self.known = quota is not None
        self.end = offset  # the size the file may reach with what is reserved
        self.reserved = False  # whether the row's reserved_bytes was set
        self.refusal: RegistryError | None = None

    async def open(self) -> None:
        if self.known:
            return
        # Not ``Database.read``: without a running total this sums the namespace's blobs.
        async with self.ctx.hub.db.reading() as session:
            held = await session.run_sync(quotas.uploads_of, self.repo_id, self.digest)
        self.quota = held.quota_left is not None

    def too_big(self) -> RegistryError:
        return RegistryError(
            Code.SIZE_INVALID,
            f"uploads are limited to {self.cap} bytes each (upload_max_bytes)",
            status=413,
        )

    async def ensure(self, needed: int, wanted: int) -> None:
        """Room for the file to reach ``needed`` bytes, reserving up to ``wanted`` (so
        the next chunks need no new reservation); raise the refusal otherwise."""
        if needed > self.cap:
            raise self.too_big()
        if self.chunk_max is not None and needed - self.offset > self.chunk_max:
            raise RegistryError(
                Code.SIZE_INVALID,
                f"one PATCH carries at most {self.chunk_max} bytes with the S3 blob backend: "
                "send the upload in smaller chunks",
                status=413,
            )
        if not self.quota or needed <= self.end:
            return
        hub = self.ctx.hub
        self.reserved = True
        self.end, self.refusal, orphans = await hub.db.write(
            _reserve,
            hub,
            self.repo_id,
            self.upload_id,
            self.offset,
            min(wanted, self.cap),
            self.digest,
        )
        for orphan in orphans:
            await _remove_bytes(hub, orphan)
        if needed > self.end:
            assert self.refusal is not None
            raise self.refusal

    async def release(self) -> None:
        """Give the reservation back (shielded: also when the request is cancelled)."""
        if not self.reserved:
            return
        self.end, self.reserved = self.offset, False
        with anyio.CancelScope(shield=True):
            async with self.ctx.hub.db.transaction() as session:
                await session.execute(
                    update(Upload).where(Upload.id == self.upload_id).values(reserved_bytes=0)
                )


def _reserve(
    session: Session,
    hub: Hub,
    repo_id: int,
    upload_id: str,
    offset: int,
    wanted: int,
    digest: str | None,
) -> tuple[int, RegistryError | None, list[str]]:
    """Under the write lock: reserve room for the session's file to grow from ``offset``
    to ``wanted`` bytes, as far as the quota allows. Before the quota refuses room, the
    namespace's orphaned sessions (``_orphaned``) are dropped: their bytes would count
    against it until they expire. Returns the size reserved, the refusal for more (None
    without a quota) and the sessions whose rows this dropped (the caller deletes their
    bytes)."""
    held = quotas.upload_sessions_locked(session, repo_id, digest)
    if held.quota_left is None:
        return wanted, None, []
    live = _live(hub, held)
    in_flight = held.in_flight(live, upload_id)
    orphans: list[str] = []
    if held.quota_left - in_flight < wanted:
        orphans = _orphaned(session, [s for s in live if s != upload_id])
        if orphans:
            session.execute(delete(Upload).where(Upload.id.in_(orphans)))
            for orphan in orphans:
                live.pop(orphan)
            in_flight = held.in_flight(live, upload_id)
    granted = max(offset, min(wanted, held.quota_left - in_flight))
    session.execute(update(Upload).where(Upload.id == upload_id).values(reserved_bytes=granted))
    assert held.quota_bytes is not None  # a quota_left comes from a quota
    reason = (
        f"storage quota of namespace {shown(held.namespace)} exceeded: "
        f"{held.used_bytes} of {held.quota_bytes} bytes used, "
        f"{in_flight + offset} more held by open upload sessions (written or reserved by "
        "uploads in flight), this upload needs more; finish or cancel unfinished uploads, "
        "or ask for a larger quota"
    )
    return granted, RegistryError(Code.DENIED, reason, message=reason), orphans


def _orphaned(session: Session, upload_ids: Iterable[str]) -> list[str]:
    """Of ``upload_ids``, the sessions whose opener can no longer push where they were
    opened: the user was removed, or holds no push on the repository now (removed from
    its organisation or team, demoted to pull). A session is its opener's alone, so
    nobody can finish these, yet until they expire (``upload_idle_timeout``) they count
    against ``upload_sessions_max``, the opener's ``upload_sessions_per_user`` and the
    namespace's quota, and could block those who may push. The opener is judged as the
    user (any of its credentials may continue a session), not by the token it used.
    Sessions without an opener (anonymous, or from before migration 0010) are not
    judged. Sync ORM code; read only when a limit or the quota would refuse."""
    rows = [
        row
        for chunk in in_chunks(upload_ids)
        for row in session.execute(
            select(Upload.id, Upload.user_id, Repository.name, Repository.is_public)
            .join(Repository, Repository.id == Upload.repository_id)
            .where(Upload.id.in_(chunk))
        )
    ]
    openers: dict[int, list[tuple[str, str, bool]]] = {}
    for upload_id, user_id, name, public in rows:
        if user_id is not None:
            openers.setdefault(user_id, []).append((upload_id, name, public))
    orphaned: list[str] = []
    for user_id, sessions in openers.items():
        user = session.get(User, user_id)
        if user is None:
            orphaned += [upload_id for upload_id, _, _ in sessions]
            continue
        opener = accounts.Principal(user.id, user.name, user.is_admin)
        grants = authz.grants(session, opener, {accounts.namespace_of(n) for _, n, _ in sessions})
        orphaned += [
            upload_id
            for upload_id, name, public in sessions
            if "push" not in grants.subject_actions(name, public)
        ]
    return orphaned


def _refused(ctx: Ctx, error: RegistryError, target: str) -> RegistryError:
    """``error``, recorded in the audit log when it is a refusal: a quota's, or the
    caller's push withdrawn while the body arrived (``RightsCheck``)."""
    if error.code in (Code.DENIED, Code.UNAUTHORIZED):
        ctx.audit("blob.push", target, "denied", reason=error.detail)
    return error


def _range_mismatch(
    ctx: Ctx, f: BinaryIO, start: int, upload_id: str, offset: int, detail: str
) -> RegistryError:
    """A chunk whose body is not the length its ``Content-Range`` declared: what it wrote
    into ``f`` (from ``start``) is dropped, and the 416 names where the upload still ends
    (``offset``) so the client resends from there."""
    f.truncate(start)
    return RegistryError(
        Code.SIZE_INVALID,
        f"{detail}: resend the chunk from byte {offset}",
        status=416,
        headers=_session_headers(ctx, upload_id, offset),
    )


def _parse_content_range(ctx: Ctx, upload_id: str, offset: int, header: str) -> tuple[int, int]:
    """``Content-Range: [bytes ]START-END[/TOTAL]`` → (START, END); 416 when malformed,
    its numbers are not ones ``parse_count`` takes, or END < START."""
    m = CONTENT_RANGE_RE.fullmatch(header.strip())
    try:
        if not m:
            raise InvalidInput("expected START-END")
        start = parse_count(m.group(1), "Content-Range start")
        end = parse_count(m.group(2), "Content-Range end")
        if m.group(3) is not None:
            parse_count(m.group(3), "Content-Range total")  # not used, but a number
        if end < start:
            raise InvalidInput(f"END {end} is before START {start}")
    except InvalidInput as exc:
        raise RegistryError(
            Code.BLOB_UPLOAD_INVALID,
            f"malformed Content-Range {header[:60]!r}: {exc}",
            status=416,
            headers=_session_headers(ctx, upload_id, offset),
        ) from None
    return start, end


async def _append(
    ctx: Ctx,
    repo_id: int,
    upload_id: str,
    digest: str | None = None,
    quota: bool | None = None,
    *,
    commit: bool = False,
) -> _Received:
    """Append the request body at the end of the session's bytes.
    ``digest``: the blob's, when the request names it (monolithic POST, closing PUT);
    then a body that is the whole blob is hashed as it arrives. ``quota``: whether a
    quota applies, when this request has read it already. ``commit`` (a ``PATCH``):
    with shared sessions, record what arrived as a chunk before answering (the closing
    ``PUT`` and a monolithic upload store the staging file's bytes directly instead).
    With ``Content-Length`` the room for all of it is reserved before a byte is read;
    without (chunked transfer) it is reserved ``RESERVE_STEP`` bytes ahead as it arrives."""
    with _open_append(ctx.hub, upload_id) as f, _exclusive(f):
        return await _append_locked(ctx, f, repo_id, upload_id, digest, quota, commit=commit)


async def _append_and_finish(
    ctx: Ctx, repo_id: int, upload_id: str, digest: str, quota: bool | None = None
) -> Response[object]:
    """The closing ``PUT`` (or a monolithic ``POST``): append the body, verify and store
    the session's bytes as ``digest``, under one hold of the session's lock, so no
    ``PATCH`` slips in between the last byte and the store (it gets 416 while this runs,
    BLOB_UPLOAD_UNKNOWN after), and no other request's lock makes this one drop the
    session."""
    with _open_append(ctx.hub, upload_id) as f, _exclusive(f):
        received = await _append_locked(ctx, f, repo_id, upload_id, digest, quota)
        return await _finish(ctx, repo_id, upload_id, digest, received, f)


async def _append_locked(
    ctx: Ctx,
    f: BinaryIO,
    repo_id: int,
    upload_id: str,
    digest: str | None,
    quota: bool | None,
    *,
    commit: bool = False,
) -> _Received:
    """``_append`` into ``f``, the session's file, which the caller opened and locked."""
    content_range = ctx.request.headers.get("content-range")
    _current(ctx.hub, upload_id, f)
    if ctx.hub.shared is None:
        # In use from now: the file's time of change is the session's idleness, and the
        # bytes this request writes may sit in its buffer a while (``_stream_into``).
        os.utime(f.fileno())
    recorded = await _recorded(ctx.hub, upload_id, f)
    f.seek(0, 2)
    start = f.tell()  # where this request's bytes begin in the file
    offset = recorded + start  # and in the upload
    expected_len = None
    if content_range:
        start, end = _parse_content_range(ctx, upload_id, offset, content_range)
        if start != offset:
            raise RegistryError(
                Code.BLOB_UPLOAD_INVALID,
                f"chunk starts at {start} but the upload has {offset} bytes",
                status=416,
                headers=_session_headers(ctx, upload_id, offset),
            )
        expected_len = end - start + 1
    # A shared session's PATCH becomes one object in the bucket: at most CHUNK_MAX, and
    # at most shared_uploads.CHUNKS_MAX of them, refused before a byte is read.
    chunk_max = CHUNK_MAX if commit and ctx.hub.shared is not None else None
    if chunk_max is not None:
        await _check_chunk_count(ctx, upload_id, offset)
    room = _Room(ctx, repo_id, upload_id, offset, digest, quota, chunk_max)
    await room.open()
    target = digest or upload_id
    declared = declared_length(ctx.request)
    hasher = dg.Hasher(dg.algorithm_of(digest)) if digest and offset == 0 else None
    try:
        try:
            if declared is not None:
                await room.ensure(offset + declared, offset + declared)
            written = await _stream_into(
                ctx, f, upload_id, offset, start, room, expected_len, hasher
            )
        except RegistryError as exc:
            raise _refused(ctx, exc, target) from None
    finally:
        await room.release()
    if expected_len is not None and written != expected_len:
        raise _range_mismatch(
            ctx,
            f,
            start,
            upload_id,
            offset,
            f"chunk has {written} bytes, Content-Range said {expected_len}",
        )
    if ctx.hub.shared is None:
        # Still the session's file, now that the bytes are in it: a session cancelled or
        # expired while they came was deleted under this request, which must not answer
        # 202 and a Range for it (a shared session's ``_commit`` finds its row gone).
        try:
            ctx.hub.uploads.check_current(upload_id, f)
        except NotFound:
            raise _unknown(
                upload_id, "was cancelled or expired while this request wrote it"
            ) from None
    if commit:
        await _commit(ctx.hub, upload_id, offset, written, f)
    return _Received(offset + written, room.quota, hasher.digest() if hasher else None)


async def _check_chunk_count(ctx: Ctx, upload_id: str, offset: int) -> None:
    """416 when the shared session holds ``shared_uploads.CHUNKS_MAX`` chunks already: a
    ``PATCH`` would add one more object and row. The session stays; its closing ``PUT``
    stores the rest (its body is not a chunk)."""
    held = await ctx.hub.db.read(shared_uploads.chunk_count, upload_id)
    most = shared_uploads.CHUNKS_MAX
    if held >= most:
        raise RegistryError(
            Code.BLOB_UPLOAD_INVALID,
            f"upload {upload_id} has {held} chunks, the most one upload may have on this "
            f"hub ({most}, its S3 storage's bound): send the rest of the blob as the body of "
            "the closing PUT ?digest=DIGEST, or upload it again in larger chunks",
            status=416,
            headers=_session_headers(ctx, upload_id, offset),
        )


async def _stream_into(
    ctx: Ctx,
    f: BinaryIO,
    upload_id: str,
    offset: int,
    start: int,
    room: _Room,
    expected_len: int | None,
    hasher: dg.Hasher | None,
) -> int:
    """Write the request body after ``offset`` (the upload's; ``start`` in ``f``) within
    ``room``; return the bytes written. A refused chunk is not kept (the file goes back to
    ``start``); what arrived before a client went away is (resumable; with shared
    sessions only once recorded, so it is not: the client resends from the Range). The
    caller's push is checked again every ``RIGHTS_RECHECK_S`` while the body arrives and
    once more after its last byte (``RightsCheck``), also while the client sends
    nothing (``checked_body``): once it is gone, nothing this request sent is kept and
    it is refused (401/403)."""
    check = RightsCheck(ctx, "push", "nothing this request sent was kept")
    written = 0
    shared = ctx.hub.shared is not None
    every = touch_every(ctx.hub.settings.upload_idle_timeout)
    # An empty shared session is touched with the first chunk: it may have been idle
    # for longer than EMPTY_SESSION_GRACE, and another replica must not reclaim it now.
    touched = time.monotonic() if offset else -every
    try:
        async with checked_body(ctx.request.stream(), check) as next_chunk:
            while (chunk := await _checked_chunk(next_chunk, f, start)) is not None:
                written += len(chunk)
                if expected_len is not None and written > expected_len:
                    raise _range_mismatch(
                        ctx,
                        f,
                        start,
                        upload_id,
                        offset,
                        f"chunk is longer than its Content-Range ({expected_len} bytes)",
                    )
                try:
                    await check()
                    await room.ensure(offset + written, offset + written + RESERVE_STEP)
                except RegistryError:
                    f.truncate(start)
                    raise
                f.write(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                ctx.hub.metrics.bytes_in.inc(len(chunk))
                if time.monotonic() - touched > every:
                    # Still in use: a shared session's idleness is its row's (other replicas'
                    # sweeps read it), which nothing else moves until this request ends; a
                    # file's is its time of change, which buffered bytes leave behind.
                    touched = time.monotonic()
                    if not shared:
                        os.utime(f.fileno())
                    elif not await ctx.hub.db.write(touch, upload_id):
                        raise _unknown(upload_id, "is gone (finished or cancelled meanwhile)")
        try:
            await check()  # the last byte may have come long after the last check
        except RegistryError:
            f.truncate(start)
            raise
    finally:
        f.flush()  # keep what arrived, even when the client went away: resumable
    return written


async def _checked_chunk(
    next_chunk: Callable[[], Awaitable[bytes | None]], f: BinaryIO, start: int
) -> bytes | None:
    """The body's next chunk (``checked_body``); a refusal while waiting for it keeps
    nothing of this request (the file goes back to ``start``)."""
    try:
        return await next_chunk()
    except RegistryError:
        f.truncate(start)
        raise


def _store(
    hub: Hub, upload_id: str, digest: str, received: _Received, chunks: _Chunks, f: BinaryIO
) -> int:
    """Verify the session's bytes against ``digest`` and store them (a thread); return the
    upload's size (the blob's once verified). ``f``: the session's file, locked by the
    caller throughout. The bytes: ``chunks`` (shared sessions' recorded chunks, in the
    bucket), then the file. Bytes that vanish meanwhile (the session cancelled or expired:
    its chunks deleted from the bucket, its file unlinked) end the session, 404
    BLOB_UPLOAD_UNKNOWN, as on every other request to it."""
    try:
        return _store_now(hub, upload_id, digest, received, chunks, f)
    except (NotFound, FileNotFoundError):
        raise _unknown(upload_id, "was cancelled or expired while this request stored it") from None


def _store_now(
    hub: Hub, upload_id: str, digest: str, received: _Received, chunks: _Chunks, f: BinaryIO
) -> int:
    """``_store``."""
    f.seek(0)
    _current(hub, upload_id, f)
    size = chunks.size + os.fstat(f.fileno()).st_size
    if hub.shared is not None:
        parts = itertools.chain(
            hub.shared.read(upload_id, chunks.keys), iter(lambda: f.read(STREAM_CHUNK), b"")
        )
        if hub.blobs.has(digest):
            dg.check(digest, _hash(parts, digest), f"upload {upload_id}")
        else:
            hub.blobs.put_stream(parts, expected=digest)
    elif isinstance(hub.blobs, FsBlobStore):
        # Hashed as received only if no other request appended since (same size).
        hashed = received.digest if received.size == size else None
        actual = hashed or dg.of_file(f, dg.algorithm_of(digest))
        dg.check(digest, actual, f"upload {upload_id}")
        # Hashing a big file takes a while, and a cancellation meanwhile deletes it: the
        # file is checked again, and one gone before the link is the session's end.
        _current(hub, upload_id, f)
        hub.blobs.link_in(hub.uploads.path(upload_id), digest)
    elif hub.blobs.has(digest):
        # The store would skip known content unread: check the client's bytes here.
        dg.check(digest, dg.of_file(f, dg.algorithm_of(digest)), f"upload {upload_id}")
    else:
        hub.blobs.put_stream(iter(lambda: f.read(STREAM_CHUNK), b""), expected=digest)
    return size


def _hash(parts: Iterable[bytes], digest: str) -> str:
    hasher = dg.Hasher(dg.algorithm_of(digest))
    for part in parts:
        hasher.update(part)
    return hasher.digest()


@dataclass(frozen=True)
class _Chunks:
    """A shared session's recorded chunks (object keys, in order) and their bytes."""

    keys: tuple[str, ...] = ()
    size: int = 0


async def _chunks(hub: Hub, upload_id: str) -> _Chunks:
    if hub.shared is None:
        return _Chunks()
    keys, size = await hub.db.read(chunk_keys, upload_id)
    return _Chunks(tuple(keys), size)


async def _finish(
    ctx: Ctx, repo_id: int, upload_id: str, digest: str, received: _Received, f: BinaryIO
) -> Response[object]:
    """Verify and store the session's bytes as ``digest``, link it, drop the session.
    ``f``: the session's file (with shared sessions this process's staging file), locked
    by the caller. With shared sessions, a ``PATCH`` another replica recorded after this
    request began is 416 and keeps the session (its bytes are not this request's)."""
    hub = ctx.hub
    chunks = await _chunks(hub, upload_id)
    if hub.shared is not None and chunks.size + os.fstat(f.fileno()).st_size != received.size:
        raise RegistryError(
            Code.BLOB_UPLOAD_INVALID,
            f"another request wrote this upload meanwhile; it now has {chunks.size} bytes "
            "recorded: resume from there (GET the upload for its Range), then PUT again",
            status=416,
            headers={"Range": _range_header(chunks.size)},
        )

    def store() -> int:
        return _store(hub, upload_id, digest, received, chunks, f)

    row_deleted = False
    try:
        try:
            # The quota first, so a refused upload stores nothing; link_blob checks again
            # under the write lock (concurrent uploads), so with no quota when this request
            # began (``received.quota``) the read is skipped: a quota set meanwhile still
            # refuses the link, and what was stored is removed.
            # Not ``Database.read``: with a quota set this sums the namespace's blobs.
            if received.quota:
                async with hub.db.reading() as session:
                    size = chunks.size + _size(hub, upload_id)
                    await session.run_sync(quotas.check, repo_id, digest, size)
        except RegistryError as exc:
            ctx.audit("blob.push", digest, "denied", reason=exc.detail)
            raise
        try:
            size = await anyio.to_thread.run_sync(store)
        except IntegrityError as exc:
            ctx.audit("blob.push", digest, "failed", reason="digest mismatch")
            raise RegistryError(Code.DIGEST_INVALID, str(exc)) from exc
        try:
            await hub.db.write(_link_upload, ctx, repo_id, upload_id, digest, size)
            row_deleted = True
        except RegistryError as exc:
            # Over quota after all, or the caller's push was withdrawn while the bytes
            # arrived: keep nothing we stored.
            ctx.audit("blob.push", digest, "denied", reason=exc.detail)
            await _discard_unrecorded(hub, digest)
            raise
        if not await anyio.to_thread.run_sync(hub.blobs.has, digest):
            # A GC sweep removed an old unreferenced copy that ``store`` found present,
            # before the link. The fresh link keeps the blob from the next sweeps (the
            # grace period), so storing it again now cannot race one.
            size = await anyio.to_thread.run_sync(store)
    finally:
        await _remove_bytes(hub, upload_id, chunks)
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
    session: Session, ctx: Ctx, repo_id: int, upload_id: str, digest: str, size: int
) -> None:
    """Link the stored blob and drop the upload's session row: one write transaction,
    which first checks that the caller may still push (``Ctx.still``: the bytes may have
    taken an hour to arrive since ``allow``)."""
    ctx.hub.db.write_lock(session)
    ctx.still(session, "push")
    link_blob(session, ctx.hub.db, repo_id, digest, size)
    session.execute(delete(Upload).where(Upload.id == upload_id))


def _add_upload(
    session: Session,
    hub: Hub,
    upload_id: str,
    repo_id: int,
    user_id: int | None,
    digest: str | None,
) -> tuple[list[str], bool, RegistryError | None]:
    """Record a new session unless its namespace has ``upload_sessions_max`` open ones or
    its user ``upload_sessions_per_user`` (in all namespaces), after reclaiming unused
    empty sessions (``EMPTY_SESSION_GRACE``), then orphaned ones (``_orphaned``), from a
    limit that is reached. Returns the
    sessions whose rows this drops (expired or reclaimed: the caller deletes their
    bytes), whether a quota applies to uploading ``digest`` (``_Room``), and the refusal
    (429; nothing recorded) when a limit is still reached."""
    held = quotas.upload_sessions_locked(session, repo_id, digest)
    live = _live(hub, held)
    stale = [s for s in held.sessions if s not in live]
    mine = _UserSessions.locked(session, hub, user_id)
    stale += [s for s in mine.sessions if s not in mine.live and s not in stale]
    namespace = f"namespace {shown(held.namespace)} has"
    limits = [(live, held.recorded, held.reserved, "upload_sessions_max", namespace)]
    if user_id is not None:  # anonymous pushes: the namespace's limit only
        mine_limit = "upload_sessions_per_user"
        limits.append((mine.live, mine.recorded, mine.reserved, mine_limit, "you have"))
    refusal = None
    for counted, recorded, reserved, setting, who in limits:
        most = getattr(hub.settings, setting)
        if len(counted) >= most:
            dropped = _reclaim_empty(hub, counted, recorded, reserved)
            if len(counted) - len(dropped) >= most:
                dropped += _orphaned(session, [s for s in counted if s not in dropped])
            for reclaimed in dropped:
                stale.append(reclaimed)
                live.pop(reclaimed, None)
                mine.live.pop(reclaimed, None)
        if len(counted) >= most and refusal is None:
            refusal = RegistryError(
                Code.TOOMANYREQUESTS,
                f"{who} {len(counted)} open upload sessions, the limit is {most} ({setting}): "
                "finish or cancel some (DELETE /v2/NAME/blobs/uploads/ID), or wait until idle "
                f"ones expire ({int(hub.settings.upload_idle_timeout)} s; empty ones after "
                f"{int(EMPTY_SESSION_GRACE)} s)",
            )
    if stale:
        session.execute(delete(Upload).where(Upload.id.in_(stale)))
    if refusal is None:
        session.add(Upload(id=upload_id, repository_id=repo_id, user_id=user_id))
    return stale, held.quota_left is not None, refusal


@dataclass(frozen=True)
class _UserSessions:
    """One user's upload session rows in every namespace (none for anonymous)."""

    sessions: list[str]
    recorded: dict[str, tuple[int, datetime]]  # id → (bytes recorded, last activity)
    reserved: dict[str, int]  # reserved_bytes of those a request is writing
    live: dict[str, int]  # those not expired: id → bytes

    @classmethod
    def locked(cls, session: Session, hub: Hub, user_id: int | None) -> _UserSessions:
        """Read under the user's lock (PostgreSQL; SQLite writers are serial), so two
        requests of one user in different namespaces cannot both take the last place.
        A user's sessions are those of every account it answers for
        (``accounts.answered_for``: itself and the robots it made, directly or through
        the organisations it created), so robots add no places to their maker's."""
        if user_id is None:
            return cls([], {}, {}, {})
        head, accounts_of = accounts.answered_for(session, user_id)
        if session.get_bind().dialect.name == "postgresql":
            session.execute(
                text("SELECT pg_advisory_xact_lock(:cls, :user)"),
                {"cls": UPLOAD_USER_LOCK_CLASS, "user": head},
            )
        rows = session.execute(
            select(
                Upload.id,
                Upload.reserved_bytes,
                Upload.size,
                func.coalesce(Upload.touched_at, Upload.created_at),
            ).where(Upload.user_id.in_(sorted(accounts_of)))
        ).all()
        sessions = [upload_id for upload_id, *_ in rows]
        recorded = {upload_id: (size, at) for upload_id, _, size, at in rows}
        reserved = {upload_id: r for upload_id, r, *_ in rows if r}
        return cls(sessions, recorded, reserved, _live_of(hub, sessions, recorded))


def _reclaim_empty(
    hub: Hub,
    live: dict[str, int],
    recorded: dict[str, tuple[int, datetime]],
    reserved: dict[str, int],
) -> list[str]:
    """Of the ``live`` sessions (id → bytes), those with no byte written, idle for more
    than ``EMPTY_SESSION_GRACE`` and that no request is writing; the caller drops their
    rows. A file-system session's file is deleted here under its lock (a writer that
    opened it finds it gone); a shared session's row must be idle (its writers touch it)
    with no reservation and its staging file unlocked in this data directory."""
    reclaimed = []
    for upload_id, size in live.items():
        if size:
            continue
        if hub.shared is None:
            if hub.uploads.remove_if_unused(upload_id, EMPTY_SESSION_GRACE):
                reclaimed.append(upload_id)
            continue
        _recorded_size, at = recorded[upload_id]
        if (
            not reserved.get(upload_id)
            and _aware(at) < expired_before(EMPTY_SESSION_GRACE)
            and not hub.uploads.in_use(upload_id)
        ):
            reclaimed.append(upload_id)
    return reclaimed


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
        # The writers' side of the GC lock before the source's link and the bytes are read:
        # read before it, a sweep (PostgreSQL: the exclusive side, taken meanwhile) could
        # remove both, and the mount would link bytes that are gone. Under it, a link that
        # is still there means its blob is too (a sweep removes the two together).
        await ctx.hub.db.lock_for_write(session)
        src = (await session.scalars(select(Repository).where(Repository.name == source))).first()
        size = await linked_blob_size(session, src.id, digest) if src else None
        if size is None or not await anyio.to_thread.run_sync(ctx.hub.blobs.has, digest):
            return None
        # Both rights, again in the transaction that links: push here, pull at the source.
        await ctx.still_async(session, "push")
        await session.run_sync(still_permitted, ctx.caller, source, "pull")
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


async def _new_session(ctx: Ctx, repo_id: int, digest: str | None = None) -> tuple[str, bool]:
    """A new session's id, and whether a quota applies to uploading ``digest`` into it."""
    upload_id = ctx.hub.uploads.new()
    user_id = ctx.caller.principal.user_id
    try:
        dropped, quota, refusal = await ctx.hub.db.write(
            _add_upload, ctx.hub, upload_id, repo_id, user_id, digest
        )
    except BaseException:
        ctx.hub.uploads.remove(upload_id)
        raise
    for stale in dropped:
        await _remove_bytes(ctx.hub, stale)
    if refusal is not None:
        ctx.hub.uploads.remove(upload_id)
        raise refusal
    return upload_id, quota


async def _allow_push(ctx: Ctx, mount_source: str | None) -> None:
    """``allow("push")``; for a mount, a challenge names the source's pull scope too, so
    a client that follows it gets a token that can mount (``_mount`` needs both)."""
    try:
        await ctx.allow("push")
    except RegistryError as exc:
        challenge = exc.headers.get("WWW-Authenticate", "")
        if mount_source and CHALLENGE_SCOPE_RE.search(challenge):
            try:
                source = validate_name(mount_source)
            except InvalidInput:
                raise exc from None
            exc.headers["WWW-Authenticate"] = CHALLENGE_SCOPE_RE.sub(
                lambda m: f'scope="{m.group(1)} repository:{source}:pull"', challenge, count=1
            )
        raise


async def start(ctx: Ctx) -> Response[object]:
    params = ctx.request.query_params
    await _allow_push(ctx, params.get("from") if params.get("mount") else None)
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
        # A session row for the request's duration: it counts against
        # ``upload_sessions_max`` and holds the upload's quota reservation.
        upload_id, quota = await _new_session(ctx, repo.id, digest)
        try:
            return await _append_and_finish(ctx, repo.id, upload_id, digest, quota)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _drop(ctx.hub, upload_id)
            raise
    upload_id, _ = await _new_session(ctx, repo.id)
    return Response(b"", status_code=202, headers=_session_headers(ctx, upload_id, 0))


def _upload(session: Session, upload_id: str) -> Upload | None:
    return session.get(Upload, upload_id)


async def _session(ctx: Ctx, upload_id: str) -> Upload:
    """Validate the session id and that it belongs to this repository and to the caller;
    return its row. A session is its opener's (the user or robot that started it, by id:
    any of that account's credentials): anyone else, whatever their access to the
    repository, gets BLOB_UPLOAD_UNKNOWN as for a session that does not exist, so an id
    seen in a log or a proxy cannot be used to write, finish or cancel someone's upload."""
    try:
        validate_upload_id(upload_id)
    except InvalidInput as exc:
        raise RegistryError(Code.BLOB_UPLOAD_UNKNOWN, str(exc)) from exc
    repo = ctx.known()
    upload = await ctx.hub.db.read(_upload, upload_id)
    if (
        upload is None
        or upload.repository_id != repo.id
        or upload.user_id != ctx.caller.principal.user_id
    ):
        raise RegistryError(
            Code.BLOB_UPLOAD_UNKNOWN,
            f"upload {upload_id} not found (in this repository, among the sessions you "
            "started); start one with POST /v2/NAME/blobs/uploads/",
        )
    timeout = ctx.hub.settings.upload_idle_timeout
    try:
        idle = (
            idle_seconds(upload)
            if ctx.hub.shared is not None
            else ctx.hub.uploads.idle_seconds(upload_id)
        )
    except NotFound:
        await _drop(ctx.hub, upload_id)
        raise _unknown(upload_id, "has lost its data") from None
    if idle > timeout:
        await _drop(ctx.hub, upload_id)
        raise _unknown(upload_id, f"expired after {int(timeout)} s without a PATCH or PUT")
    return upload


async def _drop(hub: Hub, upload_id: str) -> None:
    """Delete a session: its bytes and its row."""
    await _remove_bytes(hub, upload_id)
    async with hub.db.transaction() as session:
        await session.execute(delete(Upload).where(Upload.id == upload_id))


def _size(hub: Hub, upload_id: str) -> int:
    try:
        return hub.uploads.size(upload_id)
    except NotFound:
        raise _unknown(upload_id, "has lost its data") from None


async def patch(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    repo_id = (await _session(ctx, upload_id)).repository_id
    received = await _append(ctx, repo_id, upload_id, commit=True)
    return Response(b"", status_code=202, headers=_session_headers(ctx, upload_id, received.size))


async def put(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    repo_id = (await _session(ctx, upload_id)).repository_id
    digest = parse_digest(ctx.request.query_params.get("digest", ""))
    return await _append_and_finish(ctx, repo_id, upload_id, digest)


async def status(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    upload = await _session(ctx, upload_id)
    # Shared sessions: the bytes recorded (what any process would continue from).
    size = upload.size if ctx.hub.shared is not None else _size(ctx.hub, upload_id)
    return Response(b"", status_code=204, headers=_session_headers(ctx, upload_id, size))


async def cancel(ctx: Ctx, upload_id: str) -> Response[object]:
    await ctx.allow("push")
    await _session(ctx, upload_id)
    await _drop(ctx.hub, upload_id)
    ctx.audit("upload.cancel", upload_id)
    return Response(b"", status_code=204)
