"""A hub process with its blobs in S3 (a moto server in server mode): its settings, the
bucket's view of it, and the ``s3_hub`` fixture the S3 tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_support import HubServer
from s3_support import MOTO_CREDENTIALS, MotoServer, s3_leftovers

PREFIX = "hub"
# The hub's claim on the bucket: its database's id (hub/secrets.py), there from the
# first start on; not a blob nor anything an upload left.
OWNER_KEY = f"{PREFIX}/owner"


def s3_settings(server: MotoServer, bucket: str) -> dict[str, Any]:
    return {
        "blob_backend": "s3",
        "s3_bucket": bucket,
        "s3_endpoint_url": server.url,
        "s3_region": "us-east-1",
        "s3_prefix": PREFIX,
        "s3_access_key_id": MOTO_CREDENTIALS["access_key_id"],
        "s3_secret_access_key": MOTO_CREDENTIALS["secret_access_key"],
    }


class S3Hub(HubServer):
    bucket: str = ""
    moto: MotoServer | None = None

    def objects(self) -> set[str]:
        """The bucket's keys but the hub's claim (``OWNER_KEY``)."""
        assert self.moto is not None
        pages = self.moto.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return {obj["Key"] for page in pages for obj in page.get("Contents", [])} - {OWNER_KEY}

    def key(self, digest: str) -> str:
        return f"{PREFIX}/blobs/sha256/{digest.split(':', 1)[1]}"

    def leftovers(self) -> list[str]:
        assert self.moto is not None
        leftovers = s3_leftovers(self.moto.client(), self.bucket, f"{PREFIX}/")
        return [key for key in leftovers if key != OWNER_KEY]


@contextlib.contextmanager
def running_s3_hub(moto: MotoServer, data: Path, **settings: Any) -> Iterator[S3Hub]:
    """A hub process whose blobs are in a fresh bucket of the moto server (``settings``
    over the S3 ones), stopped however the block ends."""
    bucket = moto.new_bucket()
    server = S3Hub(data, {**s3_settings(moto, bucket), **settings})
    server.bucket, server.moto = bucket, moto
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_hub(moto_server: MotoServer, tmp_path: Path) -> Iterator[S3Hub]:
    """``running_s3_hub``; at the end the bucket holds nothing of it (no orphaned upload
    parts or blobs)."""
    with running_s3_hub(moto_server, tmp_path / "hub") as server:
        yield server
    assert server.leftovers() == []
