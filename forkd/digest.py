"""The one definition of digests in forkd.

* ``sha256:<64 hex>`` addresses every blob forkd itself writes (packs, the local
  store, what it pushes) and is the only algorithm a forkd pack may use (``validate``).
* ``sha512:<128 hex>`` is also accepted where OCI clients choose the algorithm: the
  hub's registry API and the shared blob store (``parse``, ``validate_oci``). The
  image-spec registers both (descriptor.md, "Digests"); either is lowercase hex only.
* blake3 (hex, 64 chars) is the fast internal content hash: identity of an
  uncompressed chunk, integrity of an assembled image at rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import BinaryIO, Protocol

import blake3

from forkd.errors import IntegrityError, InvalidInput
from forkd.names import matches, shown, whole

ALGORITHM = "sha256"
# Algorithm → length of its lowercase hex encoding: what ``parse`` accepts.
HEX_LENGTHS = {"sha256": 64, "sha512": 128}
_DIGEST_RE = whole(r"sha256:[a-f0-9]{64}")
_OCI_DIGEST_RE = whole("|".join(f"{a}:[a-f0-9]{{{n}}}" for a, n in HEX_LENGTHS.items()))
_BLAKE3_RE = whole(r"[a-f0-9]{64}")
READ_SIZE = 1 << 20


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def validate(digest: str) -> str:
    """Return ``digest`` if it is a well-formed sha256 digest, else raise InvalidInput."""
    if not matches(_DIGEST_RE, digest):
        raise InvalidInput(
            f"invalid digest {shown(digest)}: "
            "expected 'sha256:' followed by 64 lowercase hex digits"
        )
    return digest


def parse(digest: str) -> tuple[str, str]:
    """``(algorithm, hex)`` of a well-formed sha256 or sha512 digest, else InvalidInput.

    The whole text must match, ASCII only, lowercase hex of the algorithm's exact length.
    """
    if not matches(_OCI_DIGEST_RE, digest):
        raise InvalidInput(
            f"invalid digest {shown(digest)}: expected 'sha256:' followed by 64 "
            "or 'sha512:' followed by 128 lowercase hex digits"
        )
    algorithm, hexd = digest.split(":", 1)
    return algorithm, hexd


def validate_oci(digest: str) -> str:
    """Return ``digest`` if it is a well-formed sha256 or sha512 digest (``parse``)."""
    parse(digest)
    return digest


def algorithm_of(digest: str) -> str:
    """The algorithm of a well-formed sha256 or sha512 digest."""
    return parse(digest)[0]


def validate_blake3(value: str) -> str:
    if not matches(_BLAKE3_RE, value):
        raise InvalidInput(
            f"invalid blake3 hash {shown(value)}: expected 64 lowercase hex digits"
        )
    return value


def hex_part(digest: str) -> str:
    """The 64 hex digits of a validated digest (safe to use as a file name)."""
    return validate(digest).split(":", 1)[1]


def short(digest: str) -> str:
    """A 12-digit abbreviation for display."""
    return digest.split(":", 1)[-1][:12]


class Hasher:
    """Incremental hash producing an OCI digest string, by ``algorithm`` (sha256 or
    sha512)."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm not in HEX_LENGTHS:
            raise InvalidInput(
                f"unsupported digest algorithm {shown(algorithm, 40)}: use one of "
                + ", ".join(sorted(HEX_LENGTHS))
            )
        self.algorithm = algorithm
        self._h = hashlib.new(algorithm)

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return f"{self.algorithm}:{self._h.hexdigest()}"


def of_bytes(data: bytes | memoryview, algorithm: str = ALGORITHM) -> str:
    """The digest of a byte string (sha256 unless ``algorithm`` says sha512)."""
    h = Hasher(algorithm)
    h.update(data)
    return h.digest()


def of_chunks(chunks: Iterable[bytes | memoryview], algorithm: str = ALGORITHM) -> str:
    h = Hasher(algorithm)
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


def of_file(f: BinaryIO, algorithm: str = ALGORITHM) -> str:
    h = Hasher(algorithm)
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
