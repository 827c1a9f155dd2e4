"""Content-addressed blob storage on a local file system.

Layout (owned by this module; nothing else computes these paths)::

    ROOT/
      sha256/ab/ab12…ef      one file per blob, named by its sha256 hex, mode 0444
      sha512/ab/ab12…ef      the same for a blob an OCI client addressed by sha512
      tmp/                   in-flight writes (same file system, so rename is atomic)

A blob is written to ``tmp/``, hashed while written, fsynced, checked against
the expected digest and size, then renamed into place and the directory
fsynced. Two writers of the same content both succeed; one copy remains.
Readers check the digest before they use the bytes.

A blob is verified with its own digest's algorithm (``forkd.digest.parse``: sha256 or
sha512); a blob written without an expected digest is named by its sha256. The same
bytes pushed under both algorithms are two blobs. Whether sha512 is acceptable is the
caller's decision: forkd packs validate their digests as sha256 before they get here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, BinaryIO, Protocol

from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError, InvalidInput, NotFound

COPY_SIZE = 1 << 20


class BlobBackendError(ForkdError):
    """The backend failed a request (network, credentials, bucket): not the blob's fault."""


class BlobStore(Protocol):
    """What the hub and the engine need from any blob backend."""

    def has(self, digest: str) -> bool: ...
    def size(self, digest: str) -> int: ...
    def put_bytes(self, data: bytes, expected: str | None = None) -> str: ...
    def put_stream(
        self, chunks: Iterable[bytes], expected: str | None = None, expected_size: int | None = None
    ) -> str: ...
    def read(self, digest: str, max_size: int, what: str = "blob") -> bytes: ...
    def delete(self, digest: str) -> None: ...
    def digests(self) -> Iterator[str]: ...
    def open(self, digest: str) -> BinaryIO: ...
    def mtime(self, digest: str) -> float: ...


class StreamCheck:
    """Hash and count a blob's bytes as they stream past; refuse more than the declared size
    at once, and, at the end, fewer bytes or another digest. Every backend writes through it."""

    def __init__(self, expected: str | None, expected_size: int | None) -> None:
        self.expected = expected
        self.expected_size = expected_size
        self.written = 0
        self._hash = dg.Hasher(dg.algorithm_of(expected) if expected is not None else dg.ALGORITHM)

    def feed(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.written += len(chunk)
            if self.expected_size is not None and self.written > self.expected_size:
                raise IntegrityError(
                    f"blob {self.expected or ''} is larger than its declared size "
                    f"{self.expected_size}; refusing it"
                )
            self._hash.update(chunk)
            yield chunk

    def finish(self) -> str:
        """The digest of what streamed past, after the size and digest checks."""
        if self.expected_size is not None and self.written != self.expected_size:
            raise IntegrityError(
                f"blob {self.expected or ''} is truncated: got {self.written} bytes, "
                f"declared {self.expected_size}"
            )
        actual = self._hash.digest()
        if self.expected is not None:
            dg.check(self.expected, actual, "blob")
        return actual


class FsBlobStore:
    """Blobs as read-only files addressed by their digest (sha256 or sha512)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        (root / dg.ALGORITHM).mkdir(exist_ok=True)

    # -- layout -------------------------------------------------------------
    def path(self, digest: str) -> Path:
        algorithm, hexd = dg.parse(digest)
        return self.root / algorithm / hexd[:2] / hexd

    # -- queries ------------------------------------------------------------
    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in the store") from None

    def digests(self) -> Iterator[str]:
        """Every stored blob's digest, by algorithm; a stray file is not a blob."""
        for algorithm in sorted(dg.HEX_LENGTHS):
            base = self.root / algorithm
            if not base.is_dir():
                continue
            for sub in sorted(base.iterdir()):
                if sub.is_dir():
                    for f in sorted(sub.iterdir()):
                        with contextlib.suppress(InvalidInput):
                            yield dg.validate_oci(f"{algorithm}:{f.name}")

    def mtime(self, digest: str) -> float:
        try:
            return self.path(digest).stat().st_mtime
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in the store") from None

    # -- writes -------------------------------------------------------------
    def put_bytes(self, data: bytes, expected: str | None = None) -> str:
        return self.put_stream([data], expected, len(data) if expected else None)

    def put_stream(
        self, chunks: Iterable[bytes], expected: str | None = None, expected_size: int | None = None
    ) -> str:
        """Store a blob from an iterable of byte strings; verify, then publish atomically."""
        if expected is not None:
            dg.validate_oci(expected)
            if self.has(expected):
                # Content addressed: the bytes are already here. Drain nothing.
                return expected
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp, prefix="blob-")
        # Held until the file is published or removed: `forkd hub gc` spares locked files.
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            stream = StreamCheck(expected, expected_size)
            with os.fdopen(fd, "wb", closefd=False) as out:
                for chunk in stream.feed(chunks):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            actual = stream.finish()
            final = self.path(actual)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp_name, 0o444)
            os.replace(tmp_name, final)
            _fsync_dir(final.parent)
            return actual
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            os.close(fd)

    def link_in(self, path: Path, digest: str) -> None:
        """Publish the complete file at ``path`` as blob ``digest`` without copying it: a
        hard link (``path`` keeps its name; the caller removes it). The caller has hashed
        the file's bytes and found ``digest``, and holds off every writer of it from before
        that hash until ``path`` is gone (the hub's upload session lock). On another file
        system the bytes are copied, verified, instead."""
        dg.validate_oci(digest)
        final = self.path(digest)
        if final.is_file():
            return  # content addressed: the same bytes are here
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(path, 0o444)
        try:
            os.link(path, final)
        except FileExistsError:
            return  # another writer published the same bytes meanwhile
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with open(path, "rb") as f:
                self.put_stream(iter(lambda: f.read(COPY_SIZE), b""), digest)
            return
        _fsync_dir(final.parent)

    def delete(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(digest).unlink()

    def clear_in_flight(self) -> None:
        """Remove every in-flight write's file; only while no writer can run (gc's lock)."""
        for entry in self.tmp.iterdir():
            entry.unlink(missing_ok=True)

    # -- reads --------------------------------------------------------------
    def read(self, digest: str, max_size: int, what: str = "blob") -> bytes:
        """Read a whole blob, refusing one over ``max_size``, verified against its digest."""
        path = self.path(digest)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_size:
                    raise InvalidInput(
                        f"{what} {digest} is {size} bytes, over the limit of {max_size}; "
                        "refusing it"
                    )
                data = f.read(max_size + 1)
        except FileNotFoundError:
            raise NotFound(f"{what} {digest} is missing from the store") from None
        dg.check(digest, dg.of_bytes(data, dg.algorithm_of(digest)), f"{what} {digest}")
        return data

    def open(self, digest: str) -> BinaryIO:
        """Open a blob for streaming; the caller verifies while reading."""
        try:
            return open(self.path(digest), "rb")
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is missing from the store") from None


def put_file(
    blobs: BlobStore, f: IO[bytes], expected: str | None = None, expected_size: int | None = None
) -> str:
    """Store the rest of an open file as a blob, in ``COPY_SIZE`` reads, on any backend."""
    return blobs.put_stream(iter(lambda: f.read(COPY_SIZE), b""), expected, expected_size)


def local_path(blobs: BlobStore, digest: str) -> Path | None:
    """The blob's own file when the backend keeps blobs as local files, else None (the
    caller streams it with ``open``)."""
    return blobs.path(digest) if isinstance(blobs, FsBlobStore) else None


def room(blobs: BlobStore) -> int | None:
    """Bytes the backend can still take: the free space (for an unprivileged writer) of
    the filesystem a filesystem backend's blobs are on; None for a backend without such a
    bound (object storage)."""
    if not isinstance(blobs, FsBlobStore):
        return None
    return free_space(blobs.root)


def free_space(path: Path) -> int:
    """The free space (for an unprivileged writer) of the filesystem ``path`` is on."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def clear_in_flight(blobs: BlobStore) -> None:
    """Remove the filesystem backend's in-flight writes (its caller holds off every writer:
    a store's gc lock). Another backend's may be other hosts' writes: its own lifecycle
    rule expires them (forkd.store.s3), so nothing is removed there."""
    if isinstance(blobs, FsBlobStore):
        blobs.clear_in_flight()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
