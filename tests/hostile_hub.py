"""A hostile hub: a real HTTP server (anonymous OCI reads) serving a local store's manifests
and blobs, each blob as ``modes`` says: honest, dripped (its first bytes, then a byte every
``pause`` seconds), a body that never ends, or one that says it is gzip and is not.
``referrers`` lists any manifests of the store as a snapshot's referrers; a manifest PUT
answers ``put_digest`` (or a 307 to ``put_redirect``); ``/loop`` redirects to itself,
``/redirect?to=URL`` there; ``/error`` answers a 500 whose body never ends. What it sent
is counted (``sent``), and the paths asked for listed (``requests``), so a test can tell
what a client read."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from forkd.registry.reference import Hub
from forkd.store.store import Store

Mode = Literal["honest", "drip", "endless", "garbled"]
BLOCK = b"\0" * (64 << 10)


class HostileHub:
    def __init__(self, store: Store, tags: dict[str, str], pause: float = 0.5,
                 address: str = "127.0.0.1") -> None:
        self.store = store
        self.tags = tags  # tag -> manifest digest
        self.modes: dict[str, Mode] = {}  # blob digest -> how it is served (else honest)
        self.pause = pause
        self.referrers: dict[str, list[str]] = {}  # artifact type -> manifest digests
        self.requests: list[str] = []  # the paths asked for, in order
        self.put_digest = "sha256:" + "0" * 64  # what a PUT of a manifest answers
        self.put_redirect = ""  # else a PUT is redirected there (307: method and body kept)
        self.sent = 0  # body bytes written to clients
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    hub.answer(self)

            def do_PUT(self) -> None:  # a manifest "stored", another digest answered
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if hub.put_redirect:  # or sent on to another address
                    self.send_response(307)
                    self.send_header("Location", hub.put_redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(201)
                self.send_header("Docker-Content-Digest", hub.put_digest)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.address = address  # where it listens, and how clients address it
        self.server = ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def hub(self) -> Hub:
        return Hub(f"{self.address}:{self.server.server_address[1]}", "http")

    def __enter__(self) -> HostileHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()

    def _write(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(data)
        h.wfile.flush()
        with self._lock:
            self.sent += len(data)

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        parts = url.path.split("/")
        with self._lock:
            self.requests.append(url.path)
        if len(parts) >= 5 and parts[-2] == "referrers":
            kind = parse_qs(url.query).get("artifactType", [""])[0]
            index = {"schemaVersion": 2, "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d,
                 "size": self.store.blobs.size(d), "artifactType": kind}
                for d in self.referrers.get(kind, [])]}
            return self._plain(h, 200, json.dumps(index).encode())
        if url.path == "/error":
            h.send_response(500)
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            for chunk in self._endless():
                self._write(h, b"%x\r\n%s\r\n" % (len(chunk), chunk))
            return
        if url.path == "/loop":
            h.send_response(302)
            h.send_header("Location", "/loop")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if url.path == "/redirect":
            h.send_response(302)
            h.send_header("Location", parse_qs(url.query)["to"][0])
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if url.path == "/v2/":
            return self._plain(h, 200, b"{}")
        if len(parts) >= 5 and parts[-2] == "manifests":
            ref = parts[-1]
            digest = self.tags.get(ref, ref)
            if not self.store.blobs.has(digest):
                return self._plain(h, 404, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}')
            data = self.store.blobs.read(digest, 4 << 20)
            return self._serve(h, digest, data, {"Content-Type":
                                                 "application/vnd.oci.image.manifest.v1+json"})
        if len(parts) >= 5 and parts[-2] == "blobs":
            digest = parts[-1]
            if not self.store.blobs.has(digest):
                return self._plain(h, 404, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}')
            return self._serve(h, digest, self.store.blobs.read(digest, 1 << 30))
        self._plain(h, 404, b'{"errors": [{"code": "NAME_UNKNOWN"}]}')

    def _serve(self, h: BaseHTTPRequestHandler, digest: str, data: bytes,
               headers: dict[str, str] | None = None) -> None:
        mode = self.modes.get(digest, "honest")
        if mode == "honest":
            return self._plain(h, 200, data, headers)
        if mode == "garbled":  # says gzip, is not
            return self._plain(h, 200, data, {**(headers or {}), "Content-Encoding": "gzip"})
        h.send_response(200)
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        if mode == "drip":
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            self._write(h, data[:1])
            for i in range(1, len(data)):
                if self.stop_event.wait(self.pause):
                    return
                self._write(h, data[i : i + 1])
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for chunk in self._endless():
            self._write(h, b"%x\r\n%s\r\n" % (len(chunk), chunk))

    def _endless(self) -> Iterator[bytes]:
        deadline = time.monotonic() + 60  # a test that fails does not spin for ever
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            yield BLOCK

    def _plain(self, h: BaseHTTPRequestHandler, status: int, body: bytes,
               headers: dict[str, str] | None = None) -> None:
        h.send_response(status)
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        self._write(h, body)


def outward_address() -> str | None:
    """An address of this host that is not loopback (a hub "elsewhere"), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the address
            address: str = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address
