"""Hostile HTTP/1.1 against the real egress proxy: from a guest and from an upstream.

The guest side is a raw socket (plain HTTP to the proxy, or TLS inside a CONNECT to a
secret-bound host); the upstream side is a raw TLS server that answers with the exact
bytes a test gives. No VM.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from test_egress import (  # the shared fixtures and helpers of the proxy's tests
    REAL,
    ProxyThread,
    audit_path,
    make_proxy,
    plain,
    proxy_ca,
    raw_request,
    store,
    test_ca,
    trust,
)

from forkd.engine.egress import EgressCA, Secret, SecretStore
from forkd.engine.egress.proxy import ProxyLimits
from forkd.engine.egress.standin import StandinModel

__all__ = ["audit_path", "plain", "proxy_ca", "store", "test_ca"]  # fixtures, used by name


# -- a hostile upstream ------------------------------------------------------------------


class ScriptedUpstream:
    """A TLS server for model.test that reads one request head and answers with
    ``pieces``, written one by one with a pause between them (separate reads)."""

    def __init__(self, ca: EgressCA, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.requests: list[bytes] = []
        self.tls = ca.leaf_context("model.test")
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.sock:
            conn, _ = self.sock.accept()
            with self.tls.wrap_socket(conn, server_side=True) as tls:
                tls.settimeout(10)
                got = b""
                while b"\r\n\r\n" not in got and (data := tls.recv(65536)):
                    got += data
                self.requests.append(got)
                for piece in self.pieces:
                    tls.sendall(piece)
                    time.sleep(0.05)

    def join(self) -> None:
        self.thread.join(10)


def terminated_exchange(
    proxy: ProxyThread, port: int, ca: EgressCA, request: bytes, timeout: float = 10
) -> bytes:
    """CONNECT to model.test:port, TLS with the proxy's CA, send ``request``, read to EOF."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout) as raw:
        authority = f"model.test:{port}"
        raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
        with trust(ca).wrap_socket(raw, server_hostname="model.test") as tls:
            tls.sendall(request.replace(b"AUTHORITY", authority.encode()))
            out = b""
            try:
                while chunk := tls.recv(65536):
                    out += chunk
            except (ssl.SSLError, ConnectionResetError):
                pass
            return out


def hostile_upstream(
    pieces: list[bytes], test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit: Path
) -> tuple[ScriptedUpstream, ProxyThread, Secret]:
    upstream = ScriptedUpstream(test_ca, pieces)
    secret = store.set("OPENAI_API_KEY", REAL, [f"model.test:{upstream.port}"])
    proxy = make_proxy([f"model.test:{upstream.port}"], audit, [secret], proxy_ca, test_ca)
    return upstream, proxy, secret


def hostile_exchange(pieces: list[bytes], test_ca: EgressCA, proxy_ca: EgressCA,
                     store: SecretStore, audit: Path, request: bytes) -> tuple[bytes, Secret]:
    """The guest's ``request`` through the terminating proxy to an upstream that answers
    ``pieces``: what the guest got, and the secret bound to that upstream."""
    upstream, proxy, secret = hostile_upstream(pieces, test_ca, proxy_ca, store, audit)
    try:
        return terminated_exchange(proxy, upstream.port, proxy_ca, request), secret
    finally:
        proxy.stop()
        upstream.join()


GET = b"GET /v1/models HTTP/1.1\r\nHost: AUTHORITY\r\n\r\n"


# -- the guest's requests ----------------------------------------------------------------

SMUGGLED = {
    "obs-fold": b"X-A: a\r\n b\r\n\r\n",
    "content-length and transfer-encoding": (
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding not only chunked": b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "transfer-encoding twice": (
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding identity": b"Transfer-Encoding: identity\r\n\r\n",
    "two content-lengths": b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "signed content-length": b"Content-Length: +2\r\n\r\nab",
    "content-length list": b"Content-Length: 2, 2\r\n\r\nab",
    "space before colon": b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "control byte in a value": b"X-A: a\x01b\r\n\r\n",
    "bare LF": b"X-A: a\n\n",
    "an upgrade": b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    "chunk size not hex": b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    "chunk size overflow": b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff1\r\n",
    "chunk without its CRLF": b"Transfer-Encoding: chunked\r\n\r\n2\r\nabXX0\r\n\r\n",
}


@pytest.mark.parametrize("rest", SMUGGLED.values(), ids=SMUGGLED.keys())
def test_a_malformed_request_is_refused_and_not_answered_by_the_upstream(
    rest: bytes, plain: StandinModel, audit_path: Path
) -> None:
    proxy = make_proxy([f"plain.test:{plain.port}"], audit_path)
    try:
        head = f"POST http://plain.test:{plain.port}/v1/chat/completions HTTP/1.1\r\n"
        host = f"Host: plain.test:{plain.port}\r\n"
        reply = raw_request(proxy.port, head.encode() + host.encode() + rest)
    finally:
        proxy.stop()
    assert reply.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 501 ")), reply[:200]
    assert b"forkd egress" in reply  # the proxy's refusal, not an upstream's answer
    assert audit_lines_results(audit_path)[-1] == "denied"


def test_the_http_version_and_host_are_checked(plain: StandinModel, audit_path: Path) -> None:
    proxy = make_proxy([f"plain.test:{plain.port}"], audit_path)
    url = f"http://plain.test:{plain.port}/v1/models"
    try:
        v2 = raw_request(proxy.port, f"GET {url} HTTP/2.0\r\nHost: x\r\n\r\n".encode())
        no_host = raw_request(proxy.port, f"GET {url} HTTP/1.1\r\n\r\n".encode())
    finally:
        proxy.stop()
    assert v2.startswith(b"HTTP/1.1 505 ")
    assert no_host.startswith(b"HTTP/1.1 400 ") and b"Host" in no_host
    assert plain.requests == []


def test_an_http_1_0_guest_gets_the_body_delimited_by_the_close(
    plain: StandinModel, audit_path: Path
) -> None:
    proxy = make_proxy([f"plain.test:{plain.port}"], audit_path)
    try:
        url = f"http://plain.test:{plain.port}/download?bytes=70000"
        reply = raw_request(proxy.port, f"GET {url} HTTP/1.0\r\n\r\n".encode())
    finally:
        proxy.stop()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"chunked" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == (bytes(range(256)) * 274)[:70000]  # the stand-in's pattern, whole


def test_an_oversize_head_is_refused_whole_or_in_pieces(
    plain: StandinModel, audit_path: Path
) -> None:
    limits = ProxyLimits(head_bytes=4096)
    proxy = make_proxy([f"plain.test:{plain.port}"], audit_path, limits=limits)
    head = f"GET http://plain.test:{plain.port}/ HTTP/1.1\r\nHost: plain.test:{plain.port}\r\n"
    try:
        whole = raw_request(proxy.port, head.encode() + b"X-A: " + b"a" * 5000 + b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(head.encode() + b"X-A: ")
            with pytest.raises(OSError):  # the proxy answers and closes mid-header
                for _ in range(200):  # one header value, 100 bytes at a time
                    s.sendall(b"a" * 100)
                    time.sleep(0.002)
            pieces = s.recv(65536)
    finally:
        proxy.stop()
    assert whole.startswith(b"HTTP/1.1 431 ")
    assert pieces.startswith(b"HTTP/1.1 431 ")
    assert plain.requests == []


def test_a_smuggled_request_inside_the_tls_tunnel_is_refused(
    test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    with StandinModel(api_key=REAL, tls=test_ca.leaf_context("model.test")) as model:
        secret = store.set("OPENAI_API_KEY", REAL, [f"model.test:{model.port}"])
        proxy = make_proxy([f"model.test:{model.port}"], audit_path, [secret], proxy_ca, test_ca)
        smuggle = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: AUTHORITY\r\n"
            b"Content-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\nHost: AUTHORITY\r\n\r\n"
        )
        try:
            reply = terminated_exchange(proxy, model.port, proxy_ca, smuggle)
        finally:
            proxy.stop()
        assert model.requests == []
    assert reply.startswith(b"HTTP/1.1 400 ") and b"Transfer-Encoding" in reply


# -- the upstream's responses ------------------------------------------------------------


def test_a_secret_echoed_split_over_two_chunks_reaches_the_guest_as_its_placeholder(
    test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    body = f'{{"echo": "{REAL}"}}'.encode()
    cut = body.index(REAL.encode()) + 9  # the value is cut inside, over two reads
    pieces = [
        f"HTTP/1.1 200 OK\r\nX-Echo: Bearer {REAL}\r\nTransfer-Encoding: chunked\r\n\r\n".encode(),
        b"%x\r\n%s\r\n" % (cut, body[:cut]),
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - cut, body[cut:]),
    ]
    upstream, proxy, secret = hostile_upstream(pieces, test_ca, proxy_ca, store, audit_path)
    try:
        request = b"GET /echo HTTP/1.1\r\nHost: AUTHORITY\r\nConnection: close\r\n\r\n"
        reply = terminated_exchange(proxy, upstream.port, proxy_ca, request)
    finally:
        proxy.stop()
        upstream.join()
    assert REAL.encode() not in reply
    assert f"X-Echo: Bearer {secret.placeholder}".encode() in reply
    _, _, chunked = reply.partition(b"\r\n\r\n")
    assert dechunk(chunked) == body.replace(REAL.encode(), secret.placeholder.encode())


HOSTILE_RESPONSES = {
    "content-length and transfer-encoding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    ),
    "obs-fold": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: a\r\n b\r\n\r\nhello",
    "transfer-encoding gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello",
    "oversize head": b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (70 << 10) + b"\r\n\r\nhello",
    "a protocol switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nhello",
}


@pytest.mark.parametrize("answer", HOSTILE_RESPONSES.values(), ids=HOSTILE_RESPONSES.keys())
def test_a_malformed_response_never_reaches_the_guest(
    answer: bytes, test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    upstream, proxy, _ = hostile_upstream([answer], test_ca, proxy_ca, store, audit_path)
    try:
        reply = terminated_exchange(proxy, upstream.port, proxy_ca, GET)
    finally:
        proxy.stop()
        upstream.join()
    # The guest is told, in the proxy's own 502 (audited as failed); no byte of the
    # upstream's head or body reaches it.
    head, _, said = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502 "), reply
    assert said.startswith(b"forkd egress: the upstream's answer broke HTTP/1.1"), reply
    assert b"hello" not in reply and b"200 OK" not in reply
    records = [json.loads(line) for line in audit_path.read_text().splitlines()]
    failed = [r for r in records if r["result"] == "failed"]
    assert failed and failed[-1]["status"] == 502, records


def test_a_malformed_plain_http_answer_is_a_502_too(audit_path: Path) -> None:
    """The same for plain HTTP (no secret, no TLS): an upstream whose head folds a line."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(HOSTILE_RESPONSES["obs-fold"])

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        proxy = make_proxy([f"plain.test:{port}"], audit_path)
        try:
            request = f"GET http://plain.test:{port}/ HTTP/1.1\r\nHost: plain.test:{port}\r\n\r\n"
            reply = raw_request(proxy.port, request.encode())
        finally:
            proxy.stop()
            thread.join(10)
    assert reply.startswith(b"HTTP/1.1 502 "), reply
    assert b"hello" not in reply
    assert "failed" in audit_lines_results(audit_path)


@pytest.mark.parametrize("size", [b"zz", b"fffffffffffffffff1", b"-1"])
def test_a_bad_chunk_size_from_the_upstream_ends_the_reply_unfinished(
    size: bytes, test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    pieces = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        size + b"\r\nworld\r\n0\r\n\r\n",
    ]
    upstream, proxy, _ = hostile_upstream(pieces, test_ca, proxy_ca, store, audit_path)
    try:
        reply = terminated_exchange(proxy, upstream.port, proxy_ca, GET)
    finally:
        proxy.stop()
        upstream.join()
    assert b"world" not in reply
    assert not reply.endswith(b"0\r\n\r\n")  # the guest sees a cut message, not a whole one


def test_a_head_response_has_no_body_even_with_a_content_length(
    test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    # A HEAD answer carries Content-Length but no body; bytes after it are not a body.
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"]
    upstream, proxy, _ = hostile_upstream(pieces, test_ca, proxy_ca, store, audit_path)
    try:
        request = b"HEAD /v1/models HTTP/1.1\r\nHost: AUTHORITY\r\n\r\n"
        reply = terminated_exchange(proxy, upstream.port, proxy_ca, request)
    finally:
        proxy.stop()
        upstream.join()
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n")
    assert reply.endswith(b"\r\n\r\n") and reply.count(b"HTTP/1.1") == 1
    assert b"connection: close" in reply.lower()


# -- helpers -----------------------------------------------------------------------------


def dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2 :]


def audit_lines_results(path: Path) -> list[str]:
    return [json.loads(line)["result"] for line in path.read_text().splitlines()]
