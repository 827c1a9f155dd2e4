"""Hostile review of the client side (pull round 14): a hub that is an attacker's.

* A pack's config is the pusher's words, but only its texts were checked: its numbers
  (compat.vcpus, compat.memory_mib, compat.agent_protocol, depth, memory_size, ...) could
  be anything JSON holds. A string there was printed raw by ``forkd pull``'s "this host
  cannot fork it" warning and by ``forkd inspect`` (an escape sequence drove the user's
  terminal), ``vcpus`` went into QEMU's ``-smp`` (``"1,maxcpus=..."``: an option of the
  pusher's choosing) and any size into the engine unbounded; a non-text tag made the
  store raise a bare TypeError. A config is now refused unless each field has its type
  and its bounds (SnapshotConfig.validate), before anything is tagged.
* Credentials were stored by host alone: a user who logged in to ``hub.example`` over
  TLS, then pulled ``http://hub.example/ns/name`` (a README's command, ``$FORKD_HUB``), sent
  their password in the clear to whoever answered on port 80 (a MITM asks for it with a
  401 Basic challenge, or a Bearer one with a realm on that origin). A credential now
  records the scheme it was checked over and one checked over https (an older entry: the
  host's default scheme) is never sent over plain http.
* A token endpoint's token went into the Authorization header as it came: one with a
  character outside ASCII was a bare UnicodeEncodeError (a traceback from ``forkd
  pull``), one with a line break was sent five times over ~8 s as a "network" failure
  before an error that blamed the connection. A token must now be visible ASCII (RFC 6750
  b64token and its kin), at most ``MAX_TOKEN_CHARS``: else an AuthError naming the endpoint.
* A realm that is not a URL (``http://[::1/token``) was a bare httpx.InvalidURL, and the
  realm, a challenge's scope and an upload session's Location (the hub's words: a C1
  control such as CSI 0x9b passes HTTP's header rules) were put raw into messages that
  the SDK and the controller's logs show; each is now shown with its controls replaced.
* ``forkd compact --remote`` printed the hub's answer as it came: its digest's first 12
  characters, its counts and ``from_depth`` (an escape sequence drove the terminal; a
  text count or a missing field was a traceback). The answer is checked first
  (forkd.registry.compaction) and a malformed one is a RegistryError, quoted by no word.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hostile_hub import HostileHub, outward_address

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput
from forkd.pack import mediatypes as mt
from forkd.pack.chunking import compress
from forkd.pack.config import SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, ChunkRef, ImageMap
from forkd.pack.manifest import Descriptor, Manifest
from forkd.registry import client as registry_client
from forkd.registry import credentials
from forkd.registry.client import AuthError, RegistryClient, RegistryError
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull
from forkd.store.store import Store

ESC = "\x1b]0;owned\x07"


def good_config() -> dict[str, Any]:
    return {
        "tag": "evil/cfg:v1", "parent_tag": None, "parent_digest": None, "depth": 0,
        "memory_size": 4 * PAGE_SIZE, "disk_size": None, "page_size": PAGE_SIZE,
        "compat": {"vmm": "qemu", "vmm_version": "8.2.2", "machine": "microvm",
                   "cpu_model": "max", "accelerators": ["tcg"], "vcpus": 1,
                   "memory_mib": 256, "kernel_digest": None, "agent_protocol": 2},
        "created_at": "2026-01-01T00:00:00Z", "description": "", "recipe": None,
        "compacted_from": None, "schema": 1, "extra": {},
    }


def publish(store: Store, config: dict[str, Any]) -> str:
    """A one-layer pack whose config is ``config`` (as given, unchecked); its digest."""
    data = bytes([7]) * (4 * PAGE_SIZE)
    blob = compress(data)
    ref = ChunkRef(dg.of_bytes(blob), dg.blake3_of(data), len(data), len(blob), ((0, 4),))
    raw_map = ImageMap("flat", 4 * PAGE_SIZE, (ref,)).to_bytes()
    raw_config = json.dumps(config).encode()
    manifest = Manifest(
        config=Descriptor(mt.CONFIG, dg.of_bytes(raw_config), len(raw_config)),
        maps={"memory": Descriptor(mt.MEMORY_MAP, dg.of_bytes(raw_map), len(raw_map))},
        chunks=(Descriptor(mt.MEMORY_CHUNK, ref.digest, ref.stored),),
        files={}, subject=None, annotations={},
    ).to_bytes()
    for body in (blob, raw_map, raw_config, manifest):
        store.blobs.put_bytes(body, dg.of_bytes(body))
    return dg.of_bytes(manifest)


HOSTILE_FIELDS: list[tuple[str, Any]] = [
    ("compat.agent_protocol", ESC),
    ("compat.vcpus", "1,maxcpus=4096"),
    ("compat.vcpus", 1 << 20),
    ("compat.vcpus", 0),
    ("compat.vcpus", True),
    ("compat.memory_mib", ESC),
    ("compat.memory_mib", 1 << 60),
    ("compat.memory_mib", 65537),  # past what a recipe may ask for: a 1 TiB -m, say
    ("compat.memory_mib", 2.5),
    ("compat.accelerators", []),
    ("compat.kernel_digest", ESC),
    ("depth", ESC),
    ("depth", 1 << 40),
    ("memory_size", 8192.0),
    ("memory_size", 1 << 62),
    ("disk_size", ESC),
    ("disk_size", -4096),
    ("tag", 12),
    ("parent_digest", 12),
    ("recipe", ESC),
    ("extra", [ESC]),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE_FIELDS)
def test_a_config_field_of_the_wrong_type_or_out_of_bounds_is_refused_by_pull(
        tmp_path: Path, field: str, value: Any) -> None:
    config = good_config()
    where = config
    *outer, last = field.split(".")
    for key in outer:
        where = where[key]
    where[last] = value
    publisher = Store(tmp_path / "publisher")
    head = publish(publisher, config)
    store = Store(tmp_path / "home")
    with HostileHub(publisher, {"v1": head}) as hub, RegistryClient(hub.hub) as client, \
            pytest.raises(IntegrityError, match=last):
        pull(store, parse_remote(f"{hub.hub.host}/evil/cfg:v1"), client)
    assert store.tags.read() == {}  # nothing tagged


def test_an_honest_config_still_pulls(tmp_path: Path) -> None:
    publisher = Store(tmp_path / "publisher")
    head = publish(publisher, good_config())
    store = Store(tmp_path / "home")
    with HostileHub(publisher, {"v1": head}) as hub, RegistryClient(hub.hub) as client:
        pull(store, parse_remote(f"{hub.hub.host}/evil/cfg:v1"), client)
    assert store.config(head).compat is not None
    assert SnapshotConfig.from_bytes(json.dumps(good_config()).encode()).depth == 0


class ChallengingHub:
    """A real HTTP server that answers a request without Authorization with a 401 of
    ``challenge`` (``/token``: a token), and records every Authorization it receives."""

    def __init__(self, challenge: str, address: str = "127.0.0.1",
                 token: object = "t0k", token_redirect: str = "") -> None:
        self.challenge = challenge
        self.token = token
        self.token_redirect = token_redirect  # else /token answers 302 to it
        self.authorizations: list[tuple[str, str]] = []  # (path, header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                said = self.headers.get("Authorization")
                if said:
                    hub.authorizations.append((self.path, said))
                if self.path.startswith("/token") and hub.token_redirect:
                    body = b""
                    self.send_response(302)
                    self.send_header("Location", hub.token_redirect)
                elif self.path.startswith("/token"):
                    body = json.dumps({"token": hub.token}).encode()
                    self.send_response(200)
                elif said:
                    body = b"{}"
                    self.send_response(200)
                else:
                    body = b'{"errors": [{"code": "UNAUTHORIZED"}]}'
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", hub.challenge)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.hub = Hub(f"{address}:{self.server.server_address[1]}", "http")
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ChallengingHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


CHALLENGES = ['Basic realm="hub"', 'Bearer realm="/token",service="hub"']
SECRET = Credential("alice", "alice-secret", "https")


@pytest.fixture(params=CHALLENGES)
def challenging(request: pytest.FixtureRequest) -> Iterator[ChallengingHub]:
    with ChallengingHub(request.param) as hub:
        yield hub


def test_a_credential_checked_over_https_is_not_sent_over_plain_http(
        challenging: ChallengingHub) -> None:
    with RegistryClient(challenging.hub, SECRET) as client, \
            pytest.raises(AuthError, match="refusing to send them over plain http") as refused:
        client.ping()
    assert challenging.authorizations == []
    assert f"https://{challenging.hub.host}" in str(refused.value)


def test_a_credential_checked_over_http_still_goes_there(challenging: ChallengingHub) -> None:
    with RegistryClient(challenging.hub, Credential("alice", "alice-secret", "http")) as c:
        c.ping()
    assert challenging.authorizations  # the login the user made over http works on


def test_an_entry_without_a_scheme_is_taken_as_its_hosts_default(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry stored before the scheme was recorded: for a host that is not loopback it
    was checked over https (the default) unless the user wrote http://, which is not known:
    it is not sent over http; for a loopback hub (http by default) it is."""
    monkeypatch.setenv("FORKD_CREDENTIALS", str(home / "creds" / "credentials.json"))
    address = outward_address()
    if address is None:
        pytest.skip("this host has no address besides loopback")
    for where, refused in ((address, True), ("127.0.0.1", False)):
        with ChallengingHub(CHALLENGES[0], where) as hub:
            path = credentials.save(hub.hub.host, Credential("alice", "alice-secret"))
            assert "scheme" not in json.loads(path.read_text())[hub.hub.host]
            with RegistryClient(hub.hub, credentials.load(hub.hub.host)) as client:
                if refused:
                    with pytest.raises(AuthError, match="plain http"):
                        client.ping()
                else:
                    client.ping()
            assert bool(hub.authorizations) is not refused


def test_the_scheme_a_credential_was_checked_over_is_stored(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_CREDENTIALS", str(home / "creds" / "credentials.json"))
    credentials.save("hub.example", SECRET)
    assert credentials.load("hub.example") == SECRET


class AnsweringHub:
    """A real HTTP server that answers any POST 201 with the JSON ``answer``."""

    def __init__(self, answer: object) -> None:
        body = json.dumps(answer).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> AnsweringHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def compaction_answer() -> dict[str, Any]:
    return {"repository": "evil/app", "tag": "flat", "digest": "sha256:" + "a" * 64,
            "depth": 0, "memory_size": 4096, "stored_bytes": 10, "new_blobs": 1,
            "new_bytes": 10, "compacted_from": {"from_tag": "evil/app:v1", "from_digest":
                                                "sha256:" + "b" * 64, "from_depth": 3,
                                                "reason": "manual"}}


@pytest.mark.parametrize(("field", "value"), [
    ("digest", "x:\x1b[2J\x1b[H"),  # its first 12 characters were shown: a screen cleared
    ("new_blobs", ESC),
    ("stored_bytes", "10"),  # a traceback (human() of a text)
    ("compacted_from.from_depth", ESC),
    ("compacted_from", None),  # a traceback (a KeyError)
])
def test_forkd_compact_remote_prints_no_word_of_a_malformed_answer(
        home: Path, field: str, value: Any) -> None:
    answer = compaction_answer()
    *outer, last = field.split(".")
    where = answer
    for key in outer:
        where = where[key]
    where[last] = value
    env = {**os.environ, "FORKD_HOME": str(home),
           "FORKD_CREDENTIALS": str(home / "creds" / "credentials.json")}
    with AnsweringHub(answer) as hub:
        proc = subprocess.run(
            ["forkd", "compact", "--remote", f"{hub.address}/evil/app:v1", "--to", "flat"],
            env=env, capture_output=True, text=True, cwd="/", stdin=subprocess.DEVNULL,
            timeout=120)
    assert proc.returncode == 7, (proc.returncode, proc.stdout, proc.stderr)
    assert "compaction answer is malformed" in proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_forkd_compact_remote_prints_a_well_formed_answer(home: Path) -> None:
    env = {**os.environ, "FORKD_HOME": str(home),
           "FORKD_CREDENTIALS": str(home / "creds" / "credentials.json")}
    with AnsweringHub(compaction_answer()) as hub:
        proc = subprocess.run(
            ["forkd", "compact", "--remote", f"{hub.address}/evil/app:v1", "--to", "flat"],
            env=env, capture_output=True, text=True, cwd="/", stdin=subprocess.DEVNULL,
            timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "aaaaaaaaaaaa on the hub" in proc.stdout and "(depth 3)" in proc.stdout


@pytest.mark.parametrize("token", ["t\u2603k", "t\xe9k", "a\r\nX-Injected: 1", "a b", "\x1b[2J",
                                   pytest.param("x" * (64 << 10), id="64KiB")])
def test_an_unusable_token_is_an_auth_error_naming_the_endpoint(token: str) -> None:
    with ChallengingHub(CHALLENGES[1], token=token) as hub, RegistryClient(hub.hub) as client, \
            pytest.raises(AuthError, match=r"token endpoint .* unusable token"):
        client.ping()
    assert all("X-Injected" not in said for _, said in hub.authorizations)
    assert not [path for path, _ in hub.authorizations if not path.startswith("/token")]


def test_a_realm_that_is_not_a_url_is_an_auth_error() -> None:
    with ChallengingHub('Bearer realm="http://[::1/token"') as hub, \
            RegistryClient(hub.hub) as client, pytest.raises(AuthError, match="not a URL"):
        client.ping()


class UploadHub:
    """A real HTTP server: an upload POST opens a session at ``location``, whose PUT fails."""

    def __init__(self, location: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, headers: dict[str, str]) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self._answer(202, {"Location": location})

            def do_PUT(self) -> None:
                self._answer(500, {})

            def do_PATCH(self) -> None:
                self._answer(500, {})

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.hub = Hub(f"127.0.0.1:{self.server.server_address[1]}", "http")
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> UploadHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("chunked", [False, True])
def test_an_upload_location_is_not_put_raw_into_a_message(
        chunked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = b"pack bytes"
    if chunked:  # the session's Location is PATCHed as the hub wrote it
        monkeypatch.setattr(registry_client, "UPLOAD_CHUNK", 4)
    with UploadHub("/v2/evil/app/blobs/uploads/\x9b2J\x9bH") as hub, \
            RegistryClient(hub.hub) as client, pytest.raises(RegistryError) as failed:
        client.put_blob("evil/app", dg.of_bytes(blob), len(blob), lambda at, n: blob[at:at + n])
    assert "500" in str(failed.value) and "uploads" in str(failed.value)
    assert "\x9b" not in str(failed.value)


def test_a_token_realm_redirecting_elsewhere_gets_no_credentials_there() -> None:
    """The hub's own realm (it gets the Basic credentials) answers 302 to a token service
    on another origin: that one is asked without them (an anonymous token at most), as
    docs/push-pull.md says of any Location to another origin. A guard: httpx's redirects
    drop Authorization across origins, and this client relies on it."""
    with ChallengingHub(CHALLENGES[1]) as elsewhere, ChallengingHub(
            CHALLENGES[1], token_redirect=f"{elsewhere.hub.url}/token?x=1") as hub, \
            RegistryClient(hub.hub, Credential("alice", "alice-secret", "http")) as client:
        client.ping()  # the other service answers a token, asked anonymously
    assert [path for path, _ in hub.authorizations if path.startswith("/token")]
    assert elsewhere.authorizations == []


@pytest.mark.parametrize("entry", ["not a credential", {"username": "alice"}, ["alice", "pw"]])
def test_a_malformed_credential_entry_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: object) -> None:
    """An entry of the credentials file that is not a login (hand-edited, another tool's)
    was an AttributeError or KeyError traceback wherever forkd read it."""
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"hub.example": entry}))
    monkeypatch.setenv("FORKD_CREDENTIALS", str(path))
    with pytest.raises(InvalidInput, match=r"'hub.example' is malformed; run `forkd login"):
        credentials.load("hub.example")
