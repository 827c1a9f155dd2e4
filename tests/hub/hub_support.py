"""Fixtures: a real hub (uvicorn on a free loopback port, in a thread) and accounts made
through the real `forkd hub` commands."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from click.testing import CliRunner


def _installed_subpackages() -> None:
    """`python3 -m pytest` in the checkout imports forkd/ from the working directory, where
    the folders mapped into the package (hub/, cli/, migrations/) are absent; add the
    installed link tree to the package path so forkd.hub and forkd.cli resolve (a no-op
    under `pytest` or `python3 -P -m pytest`). The core modules stay the ones imported."""
    import importlib.util
    import sys

    import forkd

    if importlib.util.find_spec("forkd.hub") is not None:
        return
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "forkd"
        if (candidate / "hub" / "__init__.py").is_file():
            forkd.__path__.append(str(candidate))
            return


_installed_subpackages()

from forkd.cli.hub_cmds import hub as hub_group  # noqa: E402
from forkd.hub.app import create_app  # noqa: E402
from forkd.hub.settings import HubSettings  # noqa: E402

ADMIN = ("admin", "admin-password-1")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY_CONFIG = b"{}"
EMPTY_MEDIA = "application/vnd.oci.empty.v1+json"


# Generous timeouts: the suite shares two cores with VM tests and benchmarks.
TIMEOUT = 120.0
http = httpx.Client(timeout=TIMEOUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class HubServer:
    """A hub served by uvicorn in a background thread; ``stop`` is safe to call twice."""

    data_dir: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        self.port = free_port()
        settings = HubSettings(
            self.data_dir,
            port=self.port,
            admin_user=ADMIN[0],
            admin_password=ADMIN[1],
            **self.overrides,
        )
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("hub did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT)
        self._server = self._thread = None

    def cli(self, *args: str, input: str | None = None) -> str:
        """Run a `forkd hub` subcommand against this hub's data directory."""
        leaf = 1 if args[0] in ("migrate", "serve", "gc") else 2
        argv = [*args[:leaf], "--data", str(self.data_dir), *args[leaf:]]
        if "database_url" in self.overrides:
            argv[leaf:leaf] = ["--database-url", str(self.overrides["database_url"])]
        result = CliRunner().invoke(hub_group, argv, input=input, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    def add_user(self, name: str, password: str = "") -> tuple[str, str]:
        password = password or f"{name}-password-1"
        self.cli("user", "add", name, "--password-stdin", input=password + "\n")
        return name, password

    def token(self, user: str, *scopes: str) -> str:
        argv = ["token", "create", "--user", user]
        for scope in scopes:
            argv += ["--scope", scope]
        return self.cli(*argv).strip()

    def public(self, repo: str) -> None:
        self.cli("repo", "visibility", repo, "public")

    def client(self, auth: tuple[str, str] | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, auth=auth, timeout=TIMEOUT)


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
