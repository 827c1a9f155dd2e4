"""Fixtures: a real hub (uvicorn on a free loopback port, in a thread) and accounts made
through the real `forkd hub` commands."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_server import ADMIN, TIMEOUT, HubServer, free_port, sha  # noqa: F401
from sqlalchemy import event
from sqlalchemy.engine import Engine

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
RECHECK_S = 0.2  # ``quick_recheck``: how often a streaming request asks for its rights
EMPTY_CONFIG = b"{}"
EMPTY_MEDIA = "application/vnd.oci.empty.v1+json"


http = httpx.Client(timeout=TIMEOUT)


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(tmp_path_factory.mktemp("hub")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_hub(tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"login_fail_limit": 3}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def quick_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rights asked again every ``RECHECK_S`` (5 s in service) by requests that stream and
    work that runs on: the hub runs in this process."""
    from forkd.hub.oci import common

    monkeypatch.setattr(common, "RIGHTS_RECHECK_S", RECHECK_S)


def audit_log(hub: HubServer) -> list[dict[str, Any]]:
    path: Path = hub.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def audited(hub: HubServer, actor: str, action: str, result: str) -> list[dict[str, Any]]:
    """The audit log's entries of ``actor`` doing ``action`` with ``result``."""
    return [
        e
        for e in audit_log(hub)
        if e["actor"] == actor and e["action"] == action and e["result"] == result
    ]


def api_token(hub: HubServer, who: tuple[str, str], scope: str) -> tuple[str, int]:
    """A new API token of ``who`` (secret, id) with one scope (``NAMESPACE:ROLE``)."""
    with hub.client(who) as c:
        r = c.post("/api/v1/tokens", json={"name": unique_name("t"), "scopes": [scope]})
        assert r.status_code == 201, r.text
        return r.json()["token"], r.json()["id"]


@contextmanager
def browser(hub: HubServer, user: str, secret: str) -> Iterator[httpx.Client]:
    """A client signed in to the hub's UI as ``user`` (the sign-in form, its cookie)."""
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as c:
        found = re.search(r'name="login_csrf" value="([^"]*)"', c.get("/-/signin").text)
        assert found
        data = {"login_csrf": found.group(1), "username": user, "password": secret}
        assert c.post("/-/signin", data=data).status_code == 303
        yield c


def csrf_of(page: str) -> str:
    """The CSRF token of a UI page's forms."""
    found = re.search(r'name="csrf" value="([^"]*)"', page)
    assert found
    return found.group(1)


_counter = iter(range(1_000_000))


@pytest.fixture
def user(hub: HubServer) -> tuple[str, str]:
    """A new user with its own namespace, per test."""
    return hub.add_user(f"u{next(_counter)}-{time.monotonic_ns() % 100000}")


def push_blob(client: httpx.Client, repo: str, data: bytes) -> str:
    digest = sha(data)
    r = client.post(f"/v2/{repo}/blobs/uploads/", params={"digest": digest}, content=data)
    assert r.status_code == 201, r.text
    return digest


def artifact(
    client: httpx.Client,
    repo: str,
    payload: bytes,
    *,
    tag: str | None = None,
    artifact_type: str = "application/vnd.forkd.snapshot.v1",
    subject: dict[str, Any] | None = None,
) -> tuple[str, bytes]:
    """Push a one-layer OCI artifact; return (manifest digest, manifest bytes)."""
    push_blob(client, repo, EMPTY_CONFIG)
    layer = push_blob(client, repo, payload)
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
        "layers": [
            {"mediaType": "application/vnd.forkd.vmstate.v1", "digest": layer, "size": len(payload)}
        ],
        "annotations": {"org.opencontainers.image.created": "2026-11-30T00:00:00Z"},
    }
    if subject:
        manifest["subject"] = subject
    body = json.dumps(manifest).encode()
    digest = sha(body)
    r = client.put(
        f"/v2/{repo}/manifests/{tag or digest}",
        content=body,
        headers={"Content-Type": OCI_MANIFEST},
    )
    assert r.status_code == 201, r.text
    return digest, body


def error_code(response: httpx.Response) -> str:
    return str(response.json()["errors"][0]["code"])


@pytest.fixture
def postgres_url(postgres_server: Callable[[], str]) -> str:
    """A new, empty PostgreSQL database for one test."""
    return postgres_server()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_hub(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HubServer]:
    """A fresh hub on each database backend."""
    overrides: dict[str, Any] = {}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("postgres_url")
    server = HubServer(tmp_path / "hub", overrides).start()
    try:
        yield server
    finally:
        server.stop()


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Callable[[], str]]:
    """A throwaway PostgreSQL cluster (Debian's `postgresql` package), started for the tests;
    yields a function that creates a fresh database and returns its URL."""
    import os
    import shutil
    import subprocess
    import tempfile

    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is missing: apt-get install -y postgresql")
        pytest.skip("PostgreSQL not installed (apt-get install -y postgresql)")
    root = Path(tempfile.mkdtemp(prefix="forkd-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()

    def run(*argv: str) -> None:
        subprocess.run([*as_user, *argv], check=True, capture_output=True, stdin=subprocess.DEVNULL)

    run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    run(
        str(bindir / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(root / "log"),
        "-w",
        "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off",
        "start",
    )
    names = iter(range(1_000_000))

    def new_database() -> str:
        name = f"hub{next(names)}"
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", name)
        return f"postgresql://postgres@127.0.0.1:{port}/{name}"

    try:
        yield new_database
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            stdin=subprocess.DEVNULL,
        )
        shutil.rmtree(root, ignore_errors=True)


def unique_name(prefix: str) -> str:
    """A user, organisation or repository name no other test of the session uses."""
    return f"{prefix}{next(_counter)}x{time.monotonic_ns() % 10**9}"


def org_with_pusher(hub: HubServer) -> tuple[str, tuple[str, str], tuple[str, str]]:
    """A new organisation with a repository ``ORG/app`` (tag ``seed``): alice its admin,
    bob a push member. Returns (org, alice, bob)."""
    alice, bob = hub.add_user(unique_name("alice")), hub.add_user(unique_name("bob"))
    org = unique_name("org")
    with hub.client(alice) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 204, r.text
        artifact(c, f"{org}/app", b"seed layer", tag="seed")  # the repository exists
    return org, alice, bob


@contextmanager
def authorized() -> Iterator[threading.Event]:
    """An event set once the hub (in this process) has authorized a registry request
    (``Ctx.allow`` returned): a test that withdraws a right "while the request runs"
    waits for it, not for a fixed time after sending (a loaded machine's hub could
    authorize after the withdrawal, refusing the request as it began instead)."""
    from forkd.hub.oci import common

    done = threading.Event()
    real = common.Ctx.allow

    async def allow(ctx: common.Ctx, action: str) -> None:
        await real(ctx, action)
        done.set()

    common.Ctx.allow = allow  # type: ignore[method-assign]
    try:
        yield done
    finally:
        common.Ctx.allow = real  # type: ignore[method-assign]


class SlowBody:
    """A request body that drips: ``parts`` sent one by one, the first at once, the
    others only after ``go_on`` is set and then ``gap`` seconds apart. ``sent`` counts
    the parts handed to the HTTP client; ``sent_first`` is set after the first."""

    def __init__(self, parts: list[bytes], gap: float = 0.0) -> None:
        self.parts, self.gap = parts, gap
        self.sent = 0
        self.sent_first = threading.Event()
        self.go_on = threading.Event()

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)

    def __iter__(self) -> Iterator[bytes]:
        for i, part in enumerate(self.parts):
            if i == 1:
                self.sent_first.set()
                assert self.go_on.wait(TIMEOUT)
            elif i > 1:
                time.sleep(self.gap)
            self.sent += 1
            yield part


@contextmanager
def statements() -> Iterator[list[str]]:
    """The SQL every engine of this process runs meanwhile (the hub serves in a thread
    of the test's process), each statement lower case, its whitespace collapsed."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(" ".join(statement.lower().split()))

    event.listen(Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", record)
