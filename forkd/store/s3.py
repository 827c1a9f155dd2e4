"""Content-addressed blob storage in an S3 bucket (any S3 API: AWS, MinIO, Ceph, moto).

Layout (owned by this module; nothing else computes these keys)::

    s3://BUCKET/PREFIX
      blobs/sha256/<64 hex>      one object per blob, named by its sha256 hex
      blobs/sha512/<128 hex>     the same for a blob an OCI client addressed by sha512
      tmp/<uuid>                 in-flight writes of a blob whose digest is not known yet

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
from forkd.errors import ForkdError, IntegrityError, InvalidInput, NotFound
from forkd.store.blobs import StreamCheck

MiB = 1 << 20
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
PARTS_PER_STEP = 1000  # part size doubles after this many parts
READ_BUFFER = 1 * MiB
_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}


class S3StoreError(ForkdError):
    """The S3 service refused or failed a request (network, credentials, bucket)."""


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _boto_errors() -> tuple[type[Exception], type[Exception]]:
    """botocore's two error roots (imported on first use, like boto3 itself)."""
    from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

    return BotoCoreError, ClientError


@contextlib.contextmanager
def _translated(what: str, missing: str | None = None) -> Iterator[None]:
    """botocore errors → NotFound (when ``missing`` says what is absent) or S3StoreError."""
    BotoCoreError, ClientError = _boto_errors()
    try:
        yield
    except ClientError as exc:
        if missing is not None and _code(exc) in _MISSING:
            raise NotFound(missing) from None
        raise S3StoreError(f"S3 {what} failed: {exc}") from exc
    except BotoCoreError as exc:
        raise S3StoreError(f"S3 {what} failed: {exc}") from exc


def make_client(
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
) -> Any:
    """A boto3 S3 client. Credentials left empty come from the standard AWS chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance role)."""
    import boto3  # type: ignore[import-untyped]
    from botocore.config import Config  # type: ignore[import-untyped]

    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region or None,
        aws_access_key_id=access_key_id or None,
        aws_secret_access_key=secret_access_key or None,
        config=Config(
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=32,
            # Custom endpoints (MinIO, Ceph, moto) rarely have per-bucket DNS names.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
        ),
    )


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
        BotoCoreError, ClientError = _boto_errors()
        where = f"S3 bucket {self.bucket!r} at {self.client.meta.endpoint_url}"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = _code(exc)
            if code in _MISSING:
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

    # -- queries ------------------------------------------------------------
    def _head(self, digest: str) -> dict[str, Any]:
        with _translated(f"HEAD {self.key(digest)}", f"blob {digest} is not in the store"):
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
        with _translated(f"LIST {self._blob_prefix}"):
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
        upload: _Multipart | None = None
        try:
            for chunk in stream.feed(chunks):
                buf += chunk
                while len(buf) >= part_size:
                    if upload is None:
                        started = True
                        upload = _Multipart(self.client, self.bucket, target)
                    upload.add(bytes(buf[:part_size]))
                    del buf[:part_size]
                    if upload.count % PARTS_PER_STEP == 0:
                        part_size *= 2
            actual = stream.finish()
            if upload is None:  # one part: verified in memory, sent straight to its key
                with _translated(f"PUT {self.key(actual)}"):
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
        with _translated(f"COPY {tmp_key} → {self.key(digest)}"):
            self.client.copy({"Bucket": self.bucket, "Key": tmp_key}, self.bucket, self.key(digest))

    def delete(self, digest: str) -> None:
        with _translated(f"DELETE {self.key(digest)}"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(digest))

    # -- reads --------------------------------------------------------------
    def read(self, digest: str, max_size: int, what: str = "blob") -> bytes:
        """Read a whole blob, refusing one over ``max_size``, verified against its digest."""
        key = self.key(digest)
        with _translated(f"GET {key}", f"{what} {digest} is missing from the store"):
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
        raw = _ObjectReader(self.client, self.bucket, self.key(digest), size)
        return io.BufferedReader(raw, buffer_size=READ_BUFFER)


class _Multipart:
    """One multipart upload: parts added in order, then completed or aborted (once)."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        with _translated(f"CreateMultipartUpload {key}"):
            self.upload_id: str = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        self.parts: list[dict[str, Any]] = []

    @property
    def count(self) -> int:
        return len(self.parts)

    def add(self, data: bytes) -> None:
        number = len(self.parts) + 1
        with _translated(f"UploadPart {number} of {self.key}"):
            r = self.client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=data,
            )
        self.parts.append({"PartNumber": number, "ETag": r["ETag"]})

    def complete(self) -> None:
        with _translated(f"CompleteMultipartUpload {self.key}"):
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
            )

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort; a lifecycle rule cleans up the rest
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
            )


class _ObjectReader(io.RawIOBase):
    """A seekable, read-only view of one object: a ranged GET from the current offset,
    opened lazily and reopened after a seek."""

    def __init__(self, client: Any, bucket: str, key: str, size: int) -> None:
        super().__init__()
        self.client, self.bucket, self.key, self.length = client, bucket, key, size
        self.pos = 0
        self.body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        new = base + offset
        if new < 0:
            raise ValueError(f"negative seek position {new}")
        if new != self.pos:
            self._drop()
            self.pos = new
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.pos >= self.length or not len(view):
            return 0
        if self.body is None:
            with _translated(f"GET {self.key}", f"blob {self.key} is missing from the store"):
                self.body = self.client.get_object(
                    Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-"
                )["Body"]
        with _translated(f"GET {self.key}"):
            data: bytes = self.body.read(min(len(view), self.length - self.pos))
        if not data:
            raise IntegrityError(
                f"{self.key} ended at {self.pos} of {self.length} bytes; it changed or is damaged"
            )
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def _drop(self) -> None:
        if self.body is not None:
            with contextlib.suppress(Exception):
                self.body.close()
            self.body = None

    def close(self) -> None:
        self._drop()
        super().close()
