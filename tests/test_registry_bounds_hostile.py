"""A hostile hub (a real HTTP server, tests/hostile_hub.py) choosing every byte and every
pause of its answers: an error answer or a blob that never ends is refused at its bound
(the hub stops being read), a blob or a manifest dripped a byte at a time ends by its
deadline with an error naming it, and an error answer from where a redirect led (a service
on this host, say) is never quoted back to the user."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from hostile_hub import HostileHub, outward_address

from forkd import digest as dg
from forkd.errors import IntegrityError
from forkd.registry import client as registry_client
from forkd.registry.client import MAX_ANSWER_BYTES, RegistryClient, RegistryError
from forkd.store.store import Store

BLOB = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[HostileHub, str]]:
    store = Store(tmp_path / "home")
    digest = store.blobs.put_bytes(BLOB)
    with HostileHub(store, {}, pause=0.2) as hub:
        yield hub, digest


def _sink(parts: list[bytes]) -> Callable[[Iterator[bytes]], None]:
    def sink(blocks: Iterator[bytes]) -> None:
        parts.extend(blocks)

    return sink


def test_an_endless_error_answer_is_refused_at_its_bound(
        hostile: tuple[HostileHub, str]) -> None:
    hub, _ = hostile
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="goes on past"):
        client.request("GET", "/error", "registry:catalog:*")
    assert hub.sent < MAX_ANSWER_BYTES + (32 << 20)  # it stopped reading there


def test_an_endless_blob_is_refused_at_its_size(hostile: tuple[HostileHub, str]) -> None:
    hub, digest = hostile
    hub.modes[digest] = "endless"
    parts: list[bytes] = []
    with RegistryClient(hub.hub) as client, pytest.raises(IntegrityError, match="more than"):
        client.get_blob("ns/app", digest, None, len(BLOB), _sink(parts))
    assert sum(map(len, parts)) <= len(BLOB)


def test_a_dripping_blob_ends_by_its_deadline_naming_it(
        hostile: tuple[HostileHub, str]) -> None:
    hub, digest = hostile
    hub.modes[digest] = "drip"
    parts: list[bytes] = []
    start = time.monotonic()
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError) as caught:
        client.get_blob("ns/app", digest, len(BLOB), len(BLOB), _sink(parts),
                        deadline=time.monotonic() + 1.5)
    assert time.monotonic() - start < 10
    assert digest in str(caught.value) and "too slowly" in str(caught.value)


def test_the_default_blob_deadline_follows_its_size(hostile: tuple[HostileHub, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hub, digest = hostile
    hub.modes[digest] = "drip"
    monkeypatch.setattr(registry_client, "BLOB_GRACE", 1.0)
    monkeypatch.setattr(registry_client, "MIN_BLOB_RATE", len(BLOB))  # one more second
    start = time.monotonic()
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="too slowly"):
        client.get_blob("ns/app", digest, len(BLOB), len(BLOB), _sink([]))
    assert 2 <= time.monotonic() - start < 10


def test_a_dripping_manifest_ends_by_the_clients_timeout(
        hostile: tuple[HostileHub, str]) -> None:
    hub, digest = hostile
    hub.modes[digest] = "drip"  # served as a manifest too
    start = time.monotonic()
    with RegistryClient(hub.hub, timeout=1.5) as client, \
            pytest.raises(RegistryError, match="too slowly"):
        client.get_manifest("ns/app", digest)
    assert time.monotonic() - start < 10


class _Internal(BaseHTTPRequestHandler):
    """A service on this host that a redirect points at: it answers with its secrets, and
    notes any write sent to it."""

    writes: ClassVar[list[str]] = []

    def do_PUT(self) -> None:
        _Internal.writes.append(self.path)
        self.do_GET()

    def do_GET(self) -> None:
        body = b'{"errors": [{"code": "DENIED", "message": "internal-secret-42"}]}'
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_error_answer_after_a_redirect_elsewhere_is_not_quoted(
        hostile: tuple[HostileHub, str]) -> None:
    hub, _ = hostile
    internal = ThreadingHTTPServer(("127.0.0.1", 0), _Internal)
    threading.Thread(target=internal.serve_forever, daemon=True).start()
    try:
        target = f"http://127.0.0.1:{internal.server_address[1]}/admin"
        with RegistryClient(hub.hub) as client, pytest.raises(RegistryError) as caught:
            client.request("GET", "/redirect", "registry:catalog:*", params={"to": target})
    finally:
        internal.shutdown()
        internal.server_close()
    said = str(caught.value)
    assert "403" in said and "/admin" in said
    assert "internal-secret-42" not in said and not caught.value.codes


def test_a_garbled_encoding_is_a_registry_error(hostile: tuple[HostileHub, str]) -> None:
    """A body that says it is gzip and is not: a RegistryError naming the blob (a raw
    httpx error escaped the client, and a lazy server's FUSE handler, before)."""
    hub, digest = hostile
    hub.modes[digest] = "garbled"
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="unusable"):
        client.get_blob("ns/app", digest, len(BLOB), len(BLOB), _sink([]))
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="unusable"):
        client.get_manifest("ns/app", digest)


def test_a_redirect_loop_is_a_registry_error(hostile: tuple[HostileHub, str]) -> None:
    hub, _ = hostile
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="unusable"):
        client.request("GET", "/loop", "registry:catalog:*")


def test_a_manifest_digest_the_hub_made_up_is_refused(
        hostile: tuple[HostileHub, str]) -> None:
    """put_manifest returns the digest of what was sent, and a hub answering another one
    (it stored something else, or wants a made-up digest printed and published) is an
    error, not the push's result."""
    hub, _ = hostile
    data = b'{"schemaVersion": 2}'
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="did not store"):
        client.put_manifest("ns/app", "v1", data)
    hub.put_digest = dg.of_bytes(data)
    with RegistryClient(hub.hub) as client:
        assert client.put_manifest("ns/app", "v1", data) == dg.of_bytes(data)
    hub.put_digest = dg.of_bytes(data, "sha512")  # a PUT by sha512 is answered so
    with RegistryClient(hub.hub) as client:
        assert client.put_manifest("ns/app", "v1", data) == hub.put_digest


def test_a_write_redirected_elsewhere_is_not_sent_there(
        hostile: tuple[HostileHub, str]) -> None:
    """A manifest PUT answered with a 307 to a service on this host: the client does not
    follow it (its body would go there, as a 307 keeps method and body); an error."""
    hub, _ = hostile
    internal = ThreadingHTTPServer(("127.0.0.1", 0), _Internal)
    threading.Thread(target=internal.serve_forever, daemon=True).start()
    _Internal.writes.clear()
    try:
        hub.put_redirect = f"http://127.0.0.1:{internal.server_address[1]}/admin/write"
        with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="307"):
            client.put_manifest("ns/app", "v1", b'{"schemaVersion": 2}')
    finally:
        internal.shutdown()
        internal.server_close()
    assert _Internal.writes == []


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/",
                                    "http://[::ffff:169.254.169.254]/", "http://[fe80::1]/",
                                    "http://0.0.0.0:9/", "http://100.100.100.200/",
                                    "http://[fd00:ec2::254]/", "http://168.63.129.16/",
                                    "http://[64:ff9b::a9fe:a9fe]/", "http://[2002:a9fe:a9fe::]/"])
def test_a_redirect_to_a_link_local_or_reserved_address_is_refused(
        hostile: tuple[HostileHub, str], target: str) -> None:
    """A cloud's metadata service (link-local, Alibaba's in the shared range, AWS's IPv6
    one, Azure's wire server), one wrapped in IPv6 (NAT64, 6to4), an unspecified or
    reserved address: no
    registry serves from one, so a redirect there is refused before a byte is sent."""
    hub, _ = hostile
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError, match="refusing"):
        client.request("GET", "/redirect", "registry:catalog:*", params={"to": target})


def test_a_redirect_from_a_hub_elsewhere_to_this_hosts_loopback_is_refused(
        tmp_path: Path) -> None:
    """A hub that is not on this host's loopback sending a read to 127.0.0.1 (a service
    of this host, past the sandboxes' egress rules: the daemon fetches for callers):
    refused. A loopback hub's redirects to loopback go on (test setups, a local mirror)."""
    address = outward_address()
    if address is None:
        pytest.skip("this host has no address besides loopback")
    store = Store(tmp_path / "home")
    with HostileHub(store, {}, address=address) as hub, RegistryClient(hub.hub) as client, \
            pytest.raises(RegistryError, match="loopback"):
        client.request("GET", "/redirect", "registry:catalog:*",
                       params={"to": "http://127.0.0.1:9/admin"})


def _resolving(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[list[str]]]) -> list[str]:
    """Resolve each of ``names`` to its next list of addresses (the last list repeats), as
    a DNS server the hub controls would; other names resolve as usual. The asked names."""
    asked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[object]:
        if host not in names:
            return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
        asked.append(host)
        answers = names[host]
        addresses = answers[min(asked.count(host), len(answers)) - 1]
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.mark.parametrize("addresses", [["169.254.169.254"], ["10.1.2.3", "fe80::1"],
                                       ["0.0.0.0"]])
def test_a_redirect_to_a_name_of_a_link_local_or_reserved_address_is_refused(
        hostile: tuple[HostileHub, str], monkeypatch: pytest.MonkeyPatch,
        addresses: list[str]) -> None:
    """A name the hub's own DNS points at a metadata service (or one of whose addresses
    is such) is refused as the address itself is, naming both, before a byte is sent."""
    hub, _ = hostile
    asked = _resolving(monkeypatch, {"metadata.test": [addresses]})
    with RegistryClient(hub.hub) as client, pytest.raises(RegistryError) as caught:
        client.request("GET", "/redirect", "registry:catalog:*",
                       params={"to": "http://metadata.test/latest/meta-data/"})
    said = str(caught.value)
    assert "refusing" in said and "metadata.test" in said and addresses[-1] in said, said
    assert asked == ["metadata.test"]


def test_a_name_that_does_not_resolve_is_a_registry_error(
        hostile: tuple[HostileHub, str]) -> None:
    hub, _ = hostile
    with RegistryClient(hub.hub) as client, \
            pytest.raises(RegistryError, match="does not resolve"):
        client.request("GET", "/redirect", "registry:catalog:*",
                       params={"to": "http://no-such-name.invalid/x"})


class _Named(BaseHTTPRequestHandler):
    hosts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hosts.append(self.headers.get("Host", ""))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_a_name_is_resolved_once_and_the_checked_address_is_the_one_reached(
        hostile: tuple[HostileHub, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a name that resolves to an acceptable address when checked and to a
    metadata service a moment later. The request goes to the checked address (its Host
    header still the name); the name is not resolved again."""
    hub, _ = hostile
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Named)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    asked = _resolving(monkeypatch, {"rebind.test": [["127.0.0.1"], ["169.254.169.254"]]})
    port = server.server_address[1]
    try:
        with RegistryClient(hub.hub) as client:
            resp = client.request("GET", "/redirect", "registry:catalog:*",
                                  params={"to": f"http://rebind.test:{port}/ok"})
    finally:
        server.shutdown()
        server.server_close()
    assert resp.content == b"ok"
    assert asked == ["rebind.test"] and _Named.hosts == [f"rebind.test:{port}"]


def test_a_redirect_from_a_hub_elsewhere_to_a_name_of_this_hosts_loopback_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = outward_address()
    if address is None:
        pytest.skip("this host has no address besides loopback")
    _resolving(monkeypatch, {"service.test": [["127.0.0.1"]]})
    store = Store(tmp_path / "home")
    with HostileHub(store, {}, address=address) as hub, RegistryClient(hub.hub) as client, \
            pytest.raises(RegistryError, match=r"service\.test \(127\.0\.0\.1\).*loopback"):
        client.request("GET", "/redirect", "registry:catalog:*",
                       params={"to": "http://service.test:9/admin"})
