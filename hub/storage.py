"""The uploads area: bytes of unfinished blob uploads, one file per session.

Layout (owned by this module)::

    DATA/uploads/<32 hex>     bytes received so far for that upload session

Finished uploads go into the shared content-addressed store
(``forkd.store.blobs.FsBlobStore``), which verifies the digest before the blob
becomes visible; this module only keeps session bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from forkd.errors import InvalidInput, NotFound

UPLOAD_ID_RE = re.compile(r"\A[a-f0-9]{32}\Z")  # whole text: `.match` users are safe too


def validate_upload_id(upload_id: str) -> str:
    if not isinstance(upload_id, str) or not UPLOAD_ID_RE.fullmatch(upload_id):
        raise InvalidInput(f"invalid upload id {upload_id[:40]!r}")
    return upload_id


class UploadArea:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def new(self) -> str:
        upload_id = uuid.uuid4().hex
        self.path(upload_id).touch(mode=0o600, exist_ok=False)
        return upload_id

    def path(self, upload_id: str) -> Path:
        return self.root / validate_upload_id(upload_id)

    def size(self, upload_id: str) -> int:
        try:
            return self.path(upload_id).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"upload {upload_id} has no data file") from None

    def idle_seconds(self, upload_id: str) -> float:
        """Seconds since the session's bytes last changed (its file's mtime)."""
        try:
            return time.time() - self.path(upload_id).stat().st_mtime
        except FileNotFoundError:
            raise NotFound(f"upload {upload_id} has no data file") from None

    def live_sizes(self, upload_ids: list[str], idle_timeout: float) -> dict[str, int]:
        """Sizes of those sessions that have their data file and are not idle past
        ``idle_timeout`` seconds (expired or vanished ones are left out)."""
        sizes: dict[str, int] = {}
        oldest = time.time() - idle_timeout
        for upload_id in upload_ids:
            try:
                st = self.path(upload_id).stat()
            except FileNotFoundError:
                continue
            if st.st_mtime >= oldest:
                sizes[upload_id] = st.st_size
        return sizes

    def remove_if_unused(self, upload_id: str, idle: float) -> bool:
        """Delete the session's file if it is empty, unchanged for ``idle`` seconds and no
        request holds its lock (the one a writer takes, hub/oci/uploads.py); True if it
        was deleted. Under the lock, so a writer that opened it meanwhile finds it gone
        (``check_current``) and never writes to a file no session has."""
        with self._unless_locked(upload_id) as f:
            if f is None:
                return False  # gone, or a request is writing it
            st = os.fstat(f.fileno())
            if st.st_size or st.st_nlink != 1 or st.st_mtime > time.time() - idle:
                return False
            with contextlib.suppress(NotFound):
                self.check_current(upload_id, f)
                os.unlink(self.path(upload_id))
                return True
            return False

    def remove_if_idle(self, upload_id: str, before: float) -> bool:
        """Delete the session's file if it last changed before ``before`` (a time stamp)
        and no request holds its lock; True if it was deleted (or is gone). Judged and
        deleted under the lock, so a request writing it (whose bytes may still be in its
        buffer, the file's time of change behind them) keeps it, and one that opens it
        afterwards finds it gone (``check_current``)."""
        with self._unless_locked(upload_id) as f:
            if f is None:
                return not self.path(upload_id).exists()
            if os.fstat(f.fileno()).st_mtime >= before:
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(upload_id))
            return True

    def in_use(self, upload_id: str) -> bool:
        """Whether a request of this process (or another on this data directory) holds
        the lock of the session's file (with shared sessions: its staging file)."""
        try:
            fd = os.open(self.path(upload_id), os.O_RDONLY)
        except FileNotFoundError:
            return False
        with os.fdopen(fd, "rb") as f:
            return not _lock_now(f)

    @contextlib.contextmanager
    def _unless_locked(self, upload_id: str) -> Iterator[BinaryIO | None]:
        """The session's file, locked by this process meanwhile; None when it is gone or
        a request holds its lock."""
        try:
            fd = os.open(self.path(upload_id), os.O_RDONLY)
        except FileNotFoundError:
            yield None
            return
        with os.fdopen(fd, "rb") as f:
            yield f if _lock_now(f) else None

    def open_append(self, upload_id: str) -> BinaryIO:
        try:
            return open(self.path(upload_id), "r+b")
        except FileNotFoundError:
            raise NotFound(f"upload {upload_id} has no data file") from None

    def open_staging(self, upload_id: str) -> BinaryIO:
        """The session's file, made empty if this process has none: with shared sessions
        (hub/shared_uploads.py) it holds only what the request writing it received."""
        fd = os.open(self.path(upload_id), os.O_RDWR | os.O_CREAT, 0o600)
        return os.fdopen(fd, "r+b")

    def check_current(self, upload_id: str, f: BinaryIO) -> None:
        """Raise NotFound unless ``f`` (opened, then locked by the caller) is still the
        session's own data file: not removed, replaced, or published as a blob meanwhile
        (a published file has a second link), so a writer never appends to a blob."""
        st = os.fstat(f.fileno())
        try:
            named = self.path(upload_id).stat()
        except FileNotFoundError:
            raise NotFound(f"upload {upload_id} has no data file") from None
        if st.st_nlink != 1 or (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino):
            raise NotFound(f"upload {upload_id} has no data file")

    def remove(self, upload_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(upload_id))


def _lock_now(f: BinaryIO) -> bool:
    """Take ``f``'s exclusive lock if nobody holds it (it goes with the file)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
