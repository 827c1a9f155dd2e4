"""Answers of a hostile registry, nested 100 000 levels deep (issue 10 item 11): the
client reports a RegistryError in one message instead of raising RecursionError."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.reference import Hub

DEEP = b"[" * 100_000 + b"]" * 100_000


class _Hostile(BaseHTTPRequestHandler):
    """/v2/ asks for a bearer token; /token answers a deep token; /fail a deep 500."""

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path.startswith("/token"):
            self._answer(200, b'{"token": ' + DEEP + b"}")
        elif self.path.startswith("/fail"):
            self._answer(500, b'{"errors": ' + DEEP + b"}")
        else:
            challenge = f'Bearer realm="{host}/token",service="hostile"'
            self._answer(401, b"{}", {"WWW-Authenticate": challenge})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile() -> Iterator[Hub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Hub(f"127.0.0.1:{server.server_address[1]}", "http")
    finally:
        server.shutdown()
        server.server_close()


def test_deep_token_answer_is_a_registry_error(hostile: Hub) -> None:
    with RegistryClient(hostile) as client, pytest.raises(RegistryError, match="nests 100001"):
        client.ping()


def test_deep_error_answer_is_a_registry_error(hostile: Hub) -> None:
    with RegistryClient(hostile) as client, pytest.raises(RegistryError, match="500"):
        client.request("GET", "/fail", "registry:catalog:*")
