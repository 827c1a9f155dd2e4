"""The S3 API as the S3 blob store uses it: one client, errors translated into forkd's
(``NotFound`` for what is absent, ``S3StoreError`` for the service failing), a multipart
upload completed or aborted once, and a seekable reader over one object (ranged GETs)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

from forkd.errors import IntegrityError, NotFound
from forkd.store.blobs import BlobBackendError

MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}


class S3StoreError(BlobBackendError):
    """The S3 service refused or failed a request (network, credentials, bucket)."""


def error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def boto_errors() -> tuple[type[Exception], type[Exception]]:
    """botocore's two error roots (imported on first use, like boto3 itself)."""
    from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

    return BotoCoreError, ClientError


@contextlib.contextmanager
def translated(what: str, missing: str | None = None) -> Iterator[None]:
    """botocore errors → NotFound (when ``missing`` says what is absent) or S3StoreError."""
    BotoCoreError, ClientError = boto_errors()
    try:
        yield
    except ClientError as exc:
        if missing is not None and error_code(exc) in MISSING:
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


class Multipart:
    """One multipart upload: parts added in order, then completed or aborted (once)."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        with translated(f"CreateMultipartUpload {key}"):
            self.upload_id: str = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        self.parts: list[dict[str, Any]] = []

    @property
    def count(self) -> int:
        return len(self.parts)

    def add(self, data: bytes) -> None:
        number = len(self.parts) + 1
        with translated(f"UploadPart {number} of {self.key}"):
            r = self.client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=data,
            )
        self.parts.append({"PartNumber": number, "ETag": r["ETag"]})

    def complete(self) -> None:
        with translated(f"CompleteMultipartUpload {self.key}"):
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


class ObjectReader(io.RawIOBase):
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
            with translated(f"GET {self.key}", f"blob {self.key} is missing from the store"):
                self.body = self.client.get_object(
                    Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-"
                )["Body"]
        with translated(f"GET {self.key}"):
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
