"""The one definition of digests in forkd.

* ``sha256:<64 hex>`` addresses every blob on the wire and in the store (what
  OCI clients verify).
* blake3 (hex, 64 chars) is the fast internal content hash: identity of an
  uncompressed chunk, integrity of an assembled image at rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import BinaryIO, Protocol

import blake3

from forkd.errors import IntegrityError, InvalidInput
from forkd.names import matches, whole

ALGORITHM = "sha256"
_DIGEST_RE = whole(r"sha256:[a-f0-9]{64}")
_BLAKE3_RE = whole(r"[a-f0-9]{64}")
READ_SIZE = 1 << 20


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def validate(digest: str) -> str:
    """Return ``digest`` if it is a well-formed sha256 digest, else raise InvalidInput."""
    if not matches(_DIGEST_RE, digest):
        raise InvalidInput(
            f"invalid digest {str(digest)[:80]!r}: "
            "expected 'sha256:' followed by 64 lowercase hex digits"
        )
    return digest


def validate_blake3(value: str) -> str:
    if not matches(_BLAKE3_RE, value):
        raise InvalidInput(
            f"invalid blake3 hash {str(value)[:80]!r}: expected 64 lowercase hex digits"
        )
    return value


def hex_part(digest: str) -> str:
    """The 64 hex digits of a validated digest (safe to use as a file name)."""
    return validate(digest).split(":", 1)[1]


def short(digest: str) -> str:
    """A 12-digit abbreviation for display."""
    return digest.split(":", 1)[-1][:12]


class Sha256:
    """Incremental sha256 producing an OCI digest string."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def of_bytes(data: bytes | memoryview) -> str:
    """sha256 digest of a byte string."""
    return f"{ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


def of_chunks(chunks: Iterable[bytes | memoryview]) -> str:
    h = Sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


def of_file(f: BinaryIO) -> str:
    h = Sha256()
    while block := f.read(READ_SIZE):
        h.update(block)
    return h.digest()


def blake3_of(data: bytes | memoryview) -> str:
    """blake3 hex of a byte string (multi-threaded for large inputs)."""
    hasher = (
        blake3.blake3(max_threads=blake3.blake3.AUTO)
        if len(data) >= (1 << 22)
        else (blake3.blake3())
    )
    hasher.update(data)
    result: str = hasher.hexdigest()
    return result


def blake3_of_file(f: BinaryIO) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    while block := f.read(16 * READ_SIZE):
        hasher.update(block)
    result: str = hasher.hexdigest()
    return result


def check(expected: str, actual: str, what: str) -> None:
    """Raise IntegrityError naming ``what`` when two digests differ."""
    if expected != actual:
        raise IntegrityError(
            f"{what}: digest mismatch (expected {expected}, got {actual}); "
            "the bytes were altered or truncated — re-import or re-pull it"
        )
