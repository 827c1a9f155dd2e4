"""A real S3 API for tests: ``moto_server`` in a subprocess on a free port (one per session).

Shared by the blob-store conformance suite (tests/test_blobstores.py) and the hub's S3 tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from net_support import free_port

from forkd.store.s3 import make_client

START_TIMEOUT = 60.0
MOTO_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}


class MotoServer:
    """``python -m moto.server`` on a free loopback port; ``stop`` is safe to call twice."""

    def __init__(self, log_dir: Path) -> None:
        self.log_path = log_dir / "moto.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        self.port = free_port()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # ready when its API answers
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server did not start:\n{self.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/moto-api/", timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def client(self) -> Any:
        """One client per server (boto3 clients are thread-safe; making one takes ~0.3 s)."""
        if self._client is None:
            self._client = make_client(
                endpoint_url=self.url, region="us-east-1", **MOTO_CREDENTIALS
            )
        return self._client

    def new_bucket(self) -> str:
        name = f"forkd-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name


def s3_leftovers(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """Everything in ``bucket`` but published blobs: other keys and unfinished uploads."""
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
        if not obj["Key"].startswith((f"{prefix}blobs/sha256/", f"{prefix}blobs/sha512/"))
    ]
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return keys + [f"multipart upload of {u['Key']}" for u in uploads]


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    if importlib.util.find_spec("moto.server") is None or importlib.util.find_spec("flask") is None:
        if os.environ.get("CI"):
            pytest.fail("moto server mode is missing: pip install 'moto[server]'")
        pytest.skip("moto server mode not installed (pip install 'moto[server]')")
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()
