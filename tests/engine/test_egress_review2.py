"""The egress proxy against the second review: every ClientHello of a tunnel is checked,
not only the first. No VM.

After a HelloRetryRequest (RFC 8446 4.1.4) a TLS client sends a second ClientHello; a
hostile guest can make the upstream ask for one (a key share in a group it does not take)
and name another server in it. The tests use real TLS bytes: Python's ssl as the guest's
client, an upstream whose TLS (Python's ssl over memory buffers) takes only P-256 and so
asks every default client to retry, and which records every byte it got.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_egress import audit_lines, audit_path, make_proxy, test_ca, trust
from test_egress_review import openssl_hello

from forkd.engine.egress import EgressCA
from forkd.engine.egress import clienthello as ch

__all__ = ["audit_path", "test_ca"]  # fixtures, used by name

CCS = b"\x14\x03\x03\x00\x01\x01"  # change_cipher_spec, as TLS 1.3 clients send it


def u16(n: int) -> bytes:
    return n.to_bytes(2, "big")


def server_hello(random: bytes) -> bytes:
    """A TLS 1.3 ServerHello record (a HelloRetryRequest with RETRY_RANDOM)."""
    exts = b"\x00\x2b" + u16(2) + b"\x03\x04" + b"\x00\x33" + u16(2) + b"\x00\x17"
    body = b"\x03\x03" + random + b"\x00" + b"\x13\x01" + b"\x00" + u16(len(exts)) + exts
    message = b"\x02" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x03" + u16(len(message)) + message


# RFC 8446 4.1.3: the ServerHello random of a HelloRetryRequest
RETRY_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
RETRY = server_hello(RETRY_RANDOM)


def records(data: bytes) -> list[bytes]:
    out = []
    while len(data) >= 5:
        size = 5 + int.from_bytes(data[3:5], "big")
        out.append(data[:size])
        data = data[size:]
    return out


class Upstream:
    """One connection on 127.0.0.1, every byte of it kept in ``got``.

    Without ``script``: real TLS for tools.test (memory buffers over the raw socket) that
    takes only P-256, so a default client is asked to retry; it says ``hello`` once the
    handshake is done. With ``script``: each handshake record it gets is answered with the
    next of those bytes (nothing once they run out)."""

    def __init__(self, ca: EgressCA, script: list[bytes] | None = None) -> None:
        self.ctx = ca.leaf_context("tools.test")
        self.ctx.set_ecdh_curve("prime256v1")
        self.script = script
        self.got = b""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.sock, contextlib.suppress(OSError):
            conn, _ = self.sock.accept()
            with conn:
                conn.settimeout(10)
                if self.script is None:
                    self._tls(conn)
                else:
                    self._scripted(conn, list(self.script))

    def _tls(self, conn: socket.socket) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.ctx.wrap_bio(incoming, outgoing, server_side=True)
        said = False
        while data := conn.recv(65536):
            self.got += data
            incoming.write(data)
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.do_handshake()
                if not said:
                    tls.write(b"hello")
                    said = True
            conn.sendall(outgoing.read())

    def _scripted(self, conn: socket.socket, script: list[bytes]) -> None:
        seen = 0
        while data := conn.recv(65536):
            self.got += data
            hellos = [r for r in records(self.got) if r[:1] == b"\x16"]
            for _ in hellos[seen:]:
                if script:
                    conn.sendall(script.pop(0))
            seen = len(hellos)

    def join(self) -> bytes:
        self.thread.join(10)
        return self.got


@pytest.fixture
def retrying(test_ca: EgressCA) -> Iterator[Upstream]:
    upstream = Upstream(test_ca)
    yield upstream
    upstream.sock.close()


def connect(port: int, upstream_port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    authority = f"tools.test:{upstream_port}"
    s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def last_connect(audit: Path) -> dict[str, object]:
    return [e for e in audit_lines(audit) if e["action"] == "egress.connect"][-1]


def test_a_real_client_the_upstream_asks_to_retry_gets_through(
    retrying: Upstream, test_ca: EgressCA, audit_path: Path
) -> None:
    proxy = make_proxy([f"tools.test:{retrying.port}"], audit_path)
    try:
        with (
            connect(proxy.port, retrying.port) as raw,
            trust(test_ca).wrap_socket(raw, server_hostname="tools.test") as tls,
        ):
            assert tls.recv(5) == b"hello"
            assert tls.version() == "TLSv1.3"
    finally:
        proxy.stop()
    got = retrying.join()
    assert RETRY[:6] not in got and len([r for r in records(got) if r[:1] == b"\x16"]) >= 2
    assert (last_connect(audit_path)["result"], last_connect(audit_path)["tls"]) == ("ok", "tunnel")


def retried_client(name: str) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    return ctx.wrap_bio(incoming, outgoing, server_hostname=name), incoming, outgoing


def step(tls: ssl.SSLObject, outgoing: ssl.MemoryBIO) -> bytes:
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("pipelined", [False, True], ids=["after the retry", "pipelined"])
def test_a_second_client_hello_naming_another_host_is_refused(
    pipelined: bool, retrying: Upstream, audit_path: Path
) -> None:
    """The real upstream asks to retry; the guest's second ClientHello names another
    host. It never reaches the upstream, sent after the retry or ahead of it."""
    tls, _, outgoing = retried_client("tools.test")
    first = step(tls, outgoing)
    second = openssl_hello("attacker.example")  # a ClientHello, for another server
    proxy = make_proxy([f"tools.test:{retrying.port}"], audit_path)
    try:
        with connect(proxy.port, retrying.port) as s:
            if pipelined:
                s.sendall(first + CCS + second)
            else:
                s.sendall(first)
                answer = b""
                while len(records(answer)) < 1 or len(answer) < len(records(answer)[0]):
                    answer += s.recv(65536)
                assert RETRY_RANDOM in answer  # the real upstream asked to retry
                s.sendall(CCS + second)
            back = read_all(s)
    finally:
        proxy.stop()
    got = retrying.join()
    assert second not in got and got.startswith(first)
    assert back.endswith(ch.ALERT_ACCESS_DENIED)
    entry = last_connect(audit_path)
    assert entry["result"] == "denied" and "attacker.example" in str(entry["reason"])


def test_a_second_retry_is_refused(test_ca: EgressCA, audit_path: Path) -> None:
    upstream = Upstream(test_ca, script=[RETRY, RETRY])
    proxy = make_proxy([f"tools.test:{upstream.port}"], audit_path)
    first, again = openssl_hello("tools.test"), openssl_hello("tools.test")
    try:
        with connect(proxy.port, upstream.port) as s:
            s.sendall(first)
            assert s.recv(len(RETRY)) == RETRY
            s.sendall(CCS + again)  # a third ClientHello could name any server
            back = read_all(s)
    finally:
        proxy.stop()
    got = upstream.join()
    assert got == first + CCS + again
    assert back == ch.ALERT_ACCESS_DENIED  # the second retry did not reach the guest
    assert "asked for a ClientHello again" in str(last_connect(audit_path)["reason"])


ANSWERS = {
    "not TLS": (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not a TLS record"),
    "not a ServerHello": (b"\x16\x03\x03\x00\x04\x0b\x00\x00\x00", "not a ServerHello"),
    "a cut ServerHello": (b"\x16\x03\x03\x00\x08" + RETRY[5:13], "runs past its end"),
}


@pytest.mark.parametrize(("answer", "why"), ANSWERS.values(), ids=ANSWERS.keys())
def test_an_upstream_answer_the_proxy_cannot_read_ends_the_tunnel(
    answer: bytes, why: str, test_ca: EgressCA, audit_path: Path
) -> None:
    """If the proxy cannot tell whether a retry was asked for, it relays nothing more:
    the guest could otherwise send a second ClientHello unchecked."""
    upstream = Upstream(test_ca, script=[answer])
    proxy = make_proxy([f"tools.test:{upstream.port}"], audit_path)
    first = openssl_hello("tools.test")
    try:
        with connect(proxy.port, upstream.port) as s:
            s.sendall(first)
            back = read_all(s)
    finally:
        proxy.stop()
    upstream.join()
    assert back == ch.ALERT_ACCESS_DENIED
    entry = last_connect(audit_path)
    assert entry["result"] == "denied" and why in str(entry["reason"])


def test_a_guest_that_sends_no_tls_after_its_hello_is_cut_off(
    test_ca: EgressCA, audit_path: Path
) -> None:
    """Before the upstream has answered, what follows the ClientHello must be TLS records
    too (a second ClientHello could hide in bytes the proxy did not frame)."""
    upstream = Upstream(test_ca, script=[])
    proxy = make_proxy([f"tools.test:{upstream.port}"], audit_path)
    first = openssl_hello("tools.test")
    try:
        with connect(proxy.port, upstream.port) as s:
            s.sendall(first + b"GET / HTTP/1.1\r\nHost: attacker.example\r\n\r\n")
            back = read_all(s)
    finally:
        proxy.stop()
    got = upstream.join()
    assert got == first and back == ch.ALERT_ACCESS_DENIED
    assert "not a TLS record" in str(last_connect(audit_path)["reason"])
