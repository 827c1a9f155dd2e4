"""Content-addressed blob storage in an S3 bucket (any S3 API: AWS, MinIO, Ceph, moto).

Layout (owned by this module; nothing else computes these keys)::

    s3://BUCKET/PREFIX
      blobs/sha256/<64 hex>      one object per blob, named by its sha256 hex
      blobs/sha512/<128 hex>     the same for a blob an OCI client addressed by sha512
      tmp/<uuid>                 in-flight writes of a blob whose digest is not known yet
      owner                      who keeps the catalog of these blobs (``claim``: the hub
                                 writes its database's id there at its first start)

How a write becomes visible only once verified
----------------------------------------------
Bytes are hashed and counted (``StreamCheck``: by the expected digest's algorithm,
sha256 or sha512; sha256 when no digest is given) while they stream in;
memory is bounded by one part (``part_size``, 8 MiB by default).

* A blob smaller than one part is buffered, verified against its digest and
  declared size, and only then sent to its final key with one ``PutObject``.
* A larger blob goes up as a **multipart upload**, part by part while it is
  hashed. Parts of an unfinished multipart upload are not an object: nothing can
  list or read them. After the last chunk the digest and size are checked, and
  only then is the upload completed (the object appears atomically); on a
  mismatch, a truncated stream or any error the upload is aborted and nothing
  remains. When the expected digest is given (every hub upload) the multipart
  upload targets the final key directly, so there is no copy. When it is not,
  the upload targets ``tmp/<uuid>`` and the verified object is copied to its
  final key, then the temporary key is deleted.

A local temporary file was the alternative; streaming avoids a second full
copy on the hub's disk (the upload area already holds one) and a second pass.
A multipart upload left behind by a crash is invisible but billed: give the
bucket a lifecycle rule ``AbortIncompleteMultipartUpload`` (e.g. after 1 day),
and one expiring ``PREFIX/tmp/`` (never read or listed as blobs).

Two writers of the same content both succeed; S3 keeps one object (same bytes).
Part sizes grow (doubling every 1000 parts) so an upload of unknown size stays
under S3's 10 000-part limit. Readers check the digest before they use the bytes
(``read``); ``open`` streams (ranged ``GetObject``) and the caller verifies.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from forkd import digest as dg
from forkd.errors import InvalidInput, NotFound
from forkd.store.blobs import StreamCheck
from forkd.store.s3_client import (
    MISSING,
    Multipart,
    ObjectReader,
    S3StoreError,
    boto_errors,
    error_code,
    make_client,
    translated,
)

__all__ = ["DEFAULT_PART_SIZE", "MIN_PART_SIZE", "S3BlobStore", "S3StoreError", "make_client"]

MiB = 1 << 20
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
PARTS_PER_STEP = 1000  # part size doubles after this many parts
READ_BUFFER = 1 * MiB


class S3BlobStore:
    """Blobs as objects addressed by their digest (sha256 or sha512) under ``prefix`` in
    ``bucket``.

    The client is made by the caller (``make_client``): constructing the store
    opens no connection; ``check`` tells whether the bucket is usable.
    """

    def __init__(
        self, client: Any, bucket: str, prefix: str = "", *, part_size: int = DEFAULT_PART_SIZE
    ) -> None:
        if not bucket:
            raise InvalidInput("an S3 blob store needs a bucket name")
        if part_size < MIN_PART_SIZE:
            raise InvalidInput(f"S3 part size {part_size} is under S3's minimum of {MIN_PART_SIZE}")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_size = part_size

    # -- layout -------------------------------------------------------------
    def key(self, digest: str) -> str:
        algorithm, hexd = dg.parse(digest)
        return f"{self._blob_prefix}{algorithm}/{hexd}"

    def _tmp_key(self) -> str:
        return f"{self.prefix}tmp/{uuid.uuid4().hex}"

    @property
    def _blob_prefix(self) -> str:
        """Where blobs live: ``<algorithm>/<hex>`` under it."""
        return f"{self.prefix}blobs/"

    # -- start-up -------------------------------------------------------------
    def check(self) -> None:
        """Raise InvalidInput saying what to do unless the bucket exists and is reachable."""
        BotoCoreError, ClientError = boto_errors()
        where = f"S3 bucket {self.bucket!r} at {self.client.meta.endpoint_url}"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = error_code(exc)
            if code in MISSING:
                raise InvalidInput(
                    f"{where} does not exist: create it (e.g. `aws s3 mb s3://{self.bucket}`) "
                    "or set s3_bucket / --s3-bucket to an existing bucket"
                ) from None
            if code in ("403", "AccessDenied", "Forbidden"):
                raise InvalidInput(
                    f"{where} refused access: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                    "(or s3_access_key_id/s3_secret_access_key) to credentials that may "
                    "read, write, list and delete in it"
                ) from None
            raise InvalidInput(f"{where} is not usable: {exc}") from None
        except BotoCoreError as exc:
            raise InvalidInput(
                f"{where} is not reachable ({exc}): check s3_endpoint_url / --s3-endpoint, "
                "s3_region and the credentials (AWS_* environment or s3_* settings)"
            ) from None

    def claim(self, owner: str) -> str:
        """The owner recorded under the prefix (``PREFIX/owner``): ``owner`` when none was
        (recorded now), else the one that was. Read back after writing, so of two first
        claims at once each learns the one that stayed."""
        key = f"{self.prefix}owner"
        for _attempt in range(2):
            with contextlib.suppress(NotFound), translated(f"GET {key}", "no owner"):
                body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
                try:
                    return bytes(body.read(256)).decode("ascii", "replace").strip()
                finally:
                    body.close()
            with translated(f"PUT {key}"):
                self.client.put_object(Bucket=self.bucket, Key=key, Body=owner.encode() + b"\n")
        raise S3StoreError(f"S3 {key} was written but cannot be read back")

    # -- queries ------------------------------------------------------------
    def _head(self, digest: str) -> dict[str, Any]:
        with translated(f"HEAD {self.key(digest)}", f"blob {digest} is not in the store"):
            head: dict[str, Any] = self.client.head_object(Bucket=self.bucket, Key=self.key(digest))
        return head

    def has(self, digest: str) -> bool:
        try:
            self._head(digest)
        except NotFound:
            return False
        return True

    def size(self, digest: str) -> int:
        return int(self._head(digest)["ContentLength"])

    def mtime(self, digest: str) -> float:
        return float(self._head(digest)["LastModified"].timestamp())

    def digests(self) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        with translated(f"LIST {self._blob_prefix}"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._blob_prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(self._blob_prefix) :].replace("/", ":", 1)
                    with contextlib.suppress(InvalidInput):  # a stray object is not a blob
                        yield dg.validate_oci(name)

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
                return expected  # content addressed: the bytes are already here
        # Multipart target: the final key when the digest is known, else a temporary key.
        target = self.key(expected) if expected is not None else self._tmp_key()
        started = False
        stream = StreamCheck(expected, expected_size)
        part_size = self.part_size
        buf = bytearray()
        upload: Multipart | None = None
        try:
            for chunk in stream.feed(chunks):
                buf += chunk
                while len(buf) >= part_size:
                    if upload is None:
                        started = True
                        upload = Multipart(self.client, self.bucket, target)
                    upload.add(bytes(buf[:part_size]))
                    del buf[:part_size]
                    if upload.count % PARTS_PER_STEP == 0:
                        part_size *= 2
            actual = stream.finish()
            if upload is None:  # one part: verified in memory, sent straight to its key
                with translated(f"PUT {self.key(actual)}"):
                    self.client.put_object(
                        Bucket=self.bucket, Key=self.key(actual), Body=bytes(buf)
                    )
                return actual
            if buf:
                upload.add(bytes(buf))
            upload.complete()
            upload = None
            if expected is None and not self.has(actual):
                self._publish(target, actual)
            return actual
        finally:
            if upload is not None:
                upload.abort()
            if started and expected is None:
                with contextlib.suppress(Exception):  # best effort, like abort
                    self.client.delete_object(Bucket=self.bucket, Key=target)

    def _publish(self, tmp_key: str, digest: str) -> None:
        """Copy a verified temporary object to its final key (server side)."""
        with translated(f"COPY {tmp_key} → {self.key(digest)}"):
            self.client.copy({"Bucket": self.bucket, "Key": tmp_key}, self.bucket, self.key(digest))

    def delete(self, digest: str) -> None:
        with translated(f"DELETE {self.key(digest)}"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(digest))

    # -- reads --------------------------------------------------------------
    def read(self, digest: str, max_size: int, what: str = "blob") -> bytes:
        """Read a whole blob, refusing one over ``max_size``, verified against its digest."""
        key = self.key(digest)
        with translated(f"GET {key}", f"{what} {digest} is missing from the store"):
            obj = self.client.get_object(Bucket=self.bucket, Key=key)
            body = obj["Body"]
            try:
                size = int(obj["ContentLength"])
                if size > max_size:
                    raise InvalidInput(
                        f"{what} {digest} is {size} bytes, over the limit of {max_size}; "
                        "refusing it"
                    )
                data: bytes = body.read(max_size + 1)
            finally:
                body.close()
        dg.check(digest, dg.of_bytes(data, dg.algorithm_of(digest)), f"{what} {digest}")
        return data

    def open(self, digest: str) -> BinaryIO:
        """Open a blob for streaming (seekable; ranged GETs); the caller verifies."""
        size = self.size(digest)
        raw = ObjectReader(self.client, self.bucket, self.key(digest), size)
        return io.BufferedReader(raw, buffer_size=READ_BUFFER)
