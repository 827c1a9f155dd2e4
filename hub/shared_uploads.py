"""Upload sessions any replica can continue: bytes as chunk objects in the S3 bucket,
progress in the database.

With the S3 blob backend several ``forkd hub serve`` processes, each with its own data
directory, may share one database and one bucket behind a load balancer, so the
``PATCH`` requests of one upload land on different processes. Nothing of a session may
then live in one process or one data directory:

* every ``PATCH`` streams into a staging file of the process serving it (its data
  directory's uploads area, named by the session id, emptied when the request begins),
  then puts it in the bucket as one object and records it: a ``upload_chunks`` row
  (session, start, size, key) and the session's new ``size`` / ``touched_at``, in one
  transaction that only succeeds when the session still ends where the request began
  (the row's ``size``; the chunk's primary key). Of two requests writing at one offset
  one wins, the other is refused (416) and its object deleted;
* the closing ``PUT`` (or a monolithic ``POST``) reads the recorded chunks in order,
  then its own staging file, into the blob store, which verifies the digest;
* a session's size and idleness are the row's, so quotas (in-flight bytes), the
  session limit and expiry see every process's sessions alike.

Layout (owned by this module)::

    s3://BUCKET/PREFIX/uploads/<session id>/<start, 20 digits>-<16 hex>

A chunk object no row records (a process killed between the put and the commit, or a
refused writer whose delete failed) is deleted with its session, or by the sweep of
prefixes whose session is gone (``stray_sessions``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from forkd.hub.models import Upload, UploadChunk, utcnow
from forkd.hub.storage import validate_upload_id
from forkd.store.s3_client import translated

READ_CHUNK = 1 << 20
# The most one PATCH may carry: its bytes become one object, and S3 takes at most 5 GiB in
# one PutObject. Refused (413) before a byte is written, not after it reached the disk.
CHUNK_MAX = 5 << 30
# A session with no byte written, idle this long and written by no request, is reclaimed
# when its namespace or its user is at a session limit (hub/oci/uploads.py): a client
# whose POST's answer was lost retries with a new session, and the lost ones must not
# lock the namespace's uploads out until ``upload_idle_timeout``.
EMPTY_SESSION_GRACE = 60.0
# The most chunks (``PATCH``es, each an object and a row) one session may hold: S3's own
# bound on the parts of one multipart upload. Without it a session sent a byte a PATCH
# held billions of objects and rows within ``upload_max_bytes``, and its closing PUT read
# every row at once and fetched every object one by one.
CHUNKS_MAX = 10_000
DELETE_BATCH = 1000  # S3's limit per DeleteObjects
KEY_RE = re.compile(r"\A[0-9]{20}-[0-9a-f]{16}\Z")


class SharedUploads:
    """The bucket side of shared upload sessions (the S3 client is the blob store's)."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.root = f"{prefix}uploads/"

    def _session_prefix(self, upload_id: str) -> str:
        return f"{self.root}{validate_upload_id(upload_id)}/"

    def put_chunk(self, upload_id: str, start: int, f: BinaryIO) -> str:
        """Put the staging file ``f`` (from its start) as a new object; return its name
        (what ``upload_chunks.key`` records: the object's key after the session's prefix)."""
        name = f"{start:020d}-{secrets.token_hex(8)}"
        key = self._session_prefix(upload_id) + name
        f.seek(0)
        with translated(f"PUT {key}"):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=f)
        return name

    def read(self, upload_id: str, names: Iterable[str]) -> Iterator[bytes]:
        """The bytes of the session's chunks ``names``, in the order given."""
        for key in (self._session_prefix(upload_id) + name for name in names):
            with translated(f"GET {key}", f"upload chunk {key} is missing from the bucket"):
                body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
                try:
                    yield from body.iter_chunks(READ_CHUNK)
                finally:
                    body.close()

    def delete_chunks(self, upload_id: str, names: list[str]) -> None:
        self._delete_keys([self._session_prefix(upload_id) + name for name in names])

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + DELETE_BATCH]]
            with translated(f"DELETE {len(batch)} upload chunks"):
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})

    def delete_session(self, upload_id: str) -> None:
        """Delete every object of the session, recorded or not."""
        self._delete_keys([key for key, _ in self._objects(self._session_prefix(upload_id))])

    def stray_sessions(self, known: set[str], older_than: datetime) -> list[str]:
        """Sessions with objects in the bucket but no row (gone), none of them newer
        than ``older_than`` (a commit may be on its way)."""
        newest: dict[str, datetime] = {}
        for key, modified in self._objects(self.root):
            upload_id, _, name = key[len(self.root) :].partition("/")
            if not KEY_RE.fullmatch(name):
                continue
            newest[upload_id] = max(modified, newest.get(upload_id, modified))
        return sorted(u for u, at in newest.items() if u not in known and at < older_than)

    def _objects(self, prefix: str) -> Iterator[tuple[str, datetime]]:
        with translated(f"LIST {prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    yield str(obj["Key"]), obj["LastModified"]


# -- the database side ------------------------------------------------------------
def commit_chunk(session: Session, upload_id: str, start: int, size: int, key: str) -> bool:
    """Record a chunk of ``size`` bytes at ``start`` (0 bytes: only touch the session);
    False when the session no longer ends at ``start`` (another request wrote it, or it
    is gone): nothing is recorded then."""
    moved = session.execute(
        update(Upload)
        .where(Upload.id == upload_id, Upload.size == start)
        .values(size=start + size, touched_at=utcnow())
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        return False
    if size:
        session.add(UploadChunk(upload_id=upload_id, start=start, size=size, key=key))
    return True


def touch(session: Session, upload_id: str) -> bool:
    """Mark the session active now: a request is still streaming into it (a long
    ``PATCH``, ``PUT`` or monolithic ``POST`` must not expire meanwhile: nothing else
    moves ``touched_at`` until it ends). False when the session is gone."""
    moved = session.execute(
        update(Upload).where(Upload.id == upload_id).values(touched_at=utcnow())
    )
    return bool(moved.rowcount == 1)  # type: ignore[attr-defined]


def touch_every(idle: float) -> float:
    """Seconds between a streaming request's ``touch``es: well inside ``idle``, and
    inside ``EMPTY_SESSION_GRACE`` (an empty session being written is not reclaimed)."""
    return min(EMPTY_SESSION_GRACE / 3, idle / 4)


def chunk_count(session: Session, upload_id: str) -> int:
    """How many chunks the session has recorded."""
    held = session.scalar(
        select(func.count()).select_from(UploadChunk).where(UploadChunk.upload_id == upload_id)
    )
    return int(held or 0)


def chunk_keys(session: Session, upload_id: str) -> tuple[list[str], int]:
    """The names of the session's chunks in order (checked to follow one another from 0), and
    the bytes they hold."""
    rows = session.execute(
        select(UploadChunk.start, UploadChunk.size, UploadChunk.key)
        .where(UploadChunk.upload_id == upload_id)
        .order_by(UploadChunk.start)
    ).all()
    end = 0
    for start, size, _key in rows:
        if start != end:
            raise RuntimeError(f"upload {upload_id} has a gap at byte {end}: chunks corrupt")
        end = start + size
    return [key for _, _, key in rows], end


def last_activity(upload: Upload) -> datetime:
    """When a request last added to the session (or created it)."""
    return upload.touched_at or upload.created_at


def idle_seconds(upload: Upload) -> float:
    at = last_activity(upload)
    if at.tzinfo is None:  # SQLite returns naive UTC
        at = at.replace(tzinfo=utcnow().tzinfo)
    return (utcnow() - at).total_seconds()


def expired_before(idle: float) -> datetime:
    return utcnow() - timedelta(seconds=idle)
