"""A hostile registry against the client's chunked upload and its resume (review of the
replica retries): the client sends credentials only to the registry's own origin, even
where the registry's Location points elsewhere, and refuses a Range that claims more
bytes than it has sent."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from forkd.registry import client as registry_client
from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub

BLOB = b"0123456789"
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()
CHUNK = 4


class _Handler(BaseHTTPRequestHandler):
    """Records what it is sent; subclasses answer."""

    seen: ClassVar[list[tuple[str, str, str | None]]] = []

    def _answer(self, status: int, headers: dict[str, str] | None = None) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Elsewhere(_Handler):
    """Another origin a hostile registry sends the upload to: takes every chunk."""

    seen: ClassVar[list[tuple[str, str, str | None]]] = []

    def do_PATCH(self) -> None:
        self._answer(202)

    def do_PUT(self) -> None:
        self._answer(201)


class _SendsAway(_Handler):
    """Wants Basic credentials; answers the session's POST with a Location elsewhere."""

    seen: ClassVar[list[tuple[str, str, str | None]]] = []
    elsewhere: ClassVar[str] = ""

    def do_POST(self) -> None:
        if not self.headers.get("Authorization"):
            self._answer(401, {"WWW-Authenticate": 'Basic realm="hostile"'})
        else:
            self._answer(202, {"Location": f"{self.elsewhere}/v2/r/blobs/uploads/u1"})


class _ClaimsMore(_Handler):
    """Refuses the first PATCH (416), then claims to hold 9 of the 10 bytes though the
    client has sent it only the first chunk's 4."""

    seen: ClassVar[list[tuple[str, str, str | None]]] = []

    def do_POST(self) -> None:
        self._answer(202, {"Location": "/v2/r/blobs/uploads/u1"})

    def do_PATCH(self) -> None:
        self._answer(416)

    def do_GET(self) -> None:
        self._answer(204, {"Range": f"0-{len(BLOB) - 2}"})

    def do_PUT(self) -> None:
        self._answer(201)


@pytest.fixture
def serve() -> Iterator[object]:
    servers: list[ThreadingHTTPServer] = []

    def start(handler: type[_Handler]) -> str:
        handler.seen = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_client, "UPLOAD_CHUNK", CHUNK)
    monkeypatch.setattr(registry_client, "RETRY_DELAYS", ())


def test_credentials_never_follow_a_location_to_another_origin(
    serve: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunked(monkeypatch)
    start = serve
    assert callable(start)
    _SendsAway.elsewhere = "http://" + start(_Elsewhere)
    hub = Hub(start(_SendsAway), "http")
    with RegistryClient(hub, Credential("alice", "alice-secret")) as client:
        client.put_blob("r", DIGEST, len(BLOB), lambda at, n: BLOB[at : at + n])
    assert [m for m, _, _ in _Elsewhere.seen] == ["PATCH", "PATCH", "PATCH", "PUT"]
    assert [auth for _, _, auth in _Elsewhere.seen] == [None] * 4
    assert _SendsAway.seen[-1][2] is not None  # the registry itself did get them


def test_a_range_beyond_the_bytes_sent_is_refused(
    serve: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunked(monkeypatch)
    start = serve
    assert callable(start)
    hub = Hub(start(_ClaimsMore), "http")
    with (
        RegistryClient(hub) as client,
        pytest.raises(RegistryError, match="claims 9 bytes, but only 4 were sent"),
    ):
        client.put_blob("r", DIGEST, len(BLOB), lambda at, n: BLOB[at : at + n])
    assert [m for m, _, _ in _ClaimsMore.seen] == ["POST", "PATCH", "GET"]


HEAD = "sha256:" + "a" * 64
CHUNKS = ["sha256:" + f"{i:064x}" for i in range(40_000)]  # 3 MB: over a 1 MiB block


class _OrderBreaksOff(_Handler):
    """Serves an access order (engine/lazy/orders.py) whose blob stream breaks off half-way
    the first time it is fetched, as when its replica goes away."""

    seen: ClassVar[list[tuple[str, str, str | None]]] = []
    order: ClassVar[bytes] = b""
    manifest: ClassVar[bytes] = b""

    def _body(self, body: bytes, content_type: str, whole: bool = True) -> None:
        self.seen.append((self.command, self.path, None))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body if whole else body[: len(body) // 2])
        if not whole:
            self.wfile.flush()
            self.close_connection = True

    def do_GET(self) -> None:
        from forkd import digest as dg
        from forkd.pack import accessorder as ao

        if "/referrers/" in self.path:
            index = {
                "manifests": [
                    {"artifactType": ao.ACCESS_ORDER_ARTIFACT, "digest": dg.of_bytes(self.manifest)}
                ]
            }
            self._body(json.dumps(index).encode(), "application/vnd.oci.image.index.v1+json")
        elif "/manifests/" in self.path:
            self._body(self.manifest, "application/vnd.oci.image.manifest.v1+json")
        else:
            blob_gets = sum(1 for m, p, _ in self.seen if "/blobs/" in p)
            self._body(self.order, "application/octet-stream", whole=blob_gets > 0)


def test_an_access_order_whose_stream_breaks_off_is_read_again_whole(
    serve: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``get_blob`` calls its sink again after a stream broke off: a sink that kept the
    first call's blocks joined them with the second's (the order then failed its digest
    check and the prefetch lost it)."""
    from forkd.engine.lazy import orders
    from forkd.pack import accessorder as ao
    from forkd.pack import mediatypes as mt
    from forkd.pack.manifest import Descriptor

    monkeypatch.setattr(registry_client, "RETRY_DELAYS", (0.05,))
    start = serve
    assert callable(start)
    _OrderBreaksOff.order = ao.encode(HEAD, ao.Order(CHUNKS))
    _OrderBreaksOff.manifest = ao.artifact(
        Descriptor(mt.OCI_MANIFEST, HEAD, 100), _OrderBreaksOff.order
    )
    hub = Hub(start(_OrderBreaksOff), "http")
    with RegistryClient(hub) as client:
        assert orders.fetch(client, "r", HEAD) == ao.Order(CHUNKS)
    assert sum(1 for _, p, _ in _OrderBreaksOff.seen if "/blobs/" in p) == 2
