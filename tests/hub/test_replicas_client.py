"""forkd's registry client rides out a replica that goes away: a blob stream that breaks
off mid-body is fetched again (a real HTTP server on loopback that drops the first
answer half-way)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from forkd.registry import client as registry_client
from forkd.registry.client import RegistryClient
from forkd.registry.reference import Hub

BLOB = os.urandom(3 << 20)
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


class _DropsFirstAnswer(BaseHTTPRequestHandler):
    """Answers a blob GET; the first one stops after half the body and closes."""

    gets: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.gets.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB)))
        self.end_headers()
        if len(self.gets) == 1:
            self.wfile.write(BLOB[: len(BLOB) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(BLOB)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky_registry() -> Iterator[str]:
    _DropsFirstAnswer.gets = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DropsFirstAnswer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_blob_stream_that_breaks_off_is_fetched_again(
    flaky_registry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_client, "RETRY_DELAYS", (0.05,))
    got: list[bytes] = []

    def sink(blocks: Iterator[bytes]) -> None:
        got[:] = [b"".join(blocks)]

    with RegistryClient(Hub(flaky_registry, "http")) as client:
        client.get_blob("library/app", DIGEST, len(BLOB), len(BLOB), sink)
    assert got == [BLOB]
    assert _DropsFirstAnswer.gets == [f"/v2/library/app/blobs/{DIGEST}"] * 2


def test_a_stream_that_keeps_breaking_is_an_error(
    flaky_registry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_client, "RETRY_DELAYS", ())
    with (
        RegistryClient(Hub(flaky_registry, "http")) as client,
        pytest.raises(registry_client.RegistryError, match="broke off"),
    ):
        client.get_blob("library/app", DIGEST, len(BLOB), len(BLOB), lambda b: b"".join(b) and None)
