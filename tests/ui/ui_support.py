"""Helpers of the UI tests: a real hub in a thread, seeding through forkd's own client,
screenshots. A module of its own name (not conftest) so test modules can import it
whatever other conftest.py files the run has loaded."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from click.testing import CliRunner

from forkd.pack.config import Compat
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import push
from forkd.store.store import Store


def _installed_subpackages() -> None:
    """`python3 -m pytest` in the checkout imports forkd/ from the working directory, where
    the folders mapped into the package (hub/, cli/, migrations/) are absent; add the
    installed link tree to the package path so forkd.hub and forkd.cli resolve (as
    tests/hub/conftest.py does; a no-op under `pytest` or `python3 -P -m pytest`)."""
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


ADMIN = ("admin", "admin-password-1")
ALICE = ("alice", "alice-password-1")
BOB = ("bob", "bob-password-1")
IMAGE_SIZE = 8 << 20
TIMEOUT = 120.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "ui"
XSS_README = """# Dev box

A warm Python dev box. <script>window.__pwned = 1; alert("script")</script>

<img src=x onerror="window.__pwned = 2; alert('onerror')">

[click me](javascript:alert('link'))

| pages | state |
|-------|-------|
| 2048  | warm  |
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        from forkd.hub.app import create_app
        from forkd.hub.settings import HubSettings

        self.port = free_port()
        settings = HubSettings(
            self.data_dir,
            port=self.port,
            admin_user=ADMIN[0],
            admin_password=ADMIN[1],
            **self.overrides,
        )
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning"
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
        from forkd.cli.hub_cmds import hub as hub_group

        leaf = 1 if args[0] in ("migrate", "serve", "gc") else 2
        argv = [*args[:leaf], "--data", str(self.data_dir), *args[leaf:]]
        # In a thread of its own: the command runs asyncio.run(), and Playwright's sync API
        # keeps an event loop on the main thread once a browser is up.
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(
                CliRunner().invoke, hub_group, argv, input=input, catch_exceptions=False
            ).result()
        assert result.exit_code == 0, result.output
        return result.output

    def add_user(self, name: str, password: str) -> None:
        self.cli("user", "add", name, "--password-stdin", input=password + "\n")

    @property
    def target(self) -> Hub:
        return Hub(self.address, "http")

    def client(self, who: tuple[str, str]) -> RegistryClient:
        return RegistryClient(self.target, Credential(*who))

    def push(self, store: Store, local: str, remote: str, who: tuple[str, str]) -> str:
        with self.client(who) as client:
            return push(store, local, parse_remote(f"{self.address}/{remote}"), client).digest


def compat(vmm: str, accelerators: list[str]) -> Compat:
    return Compat(
        vmm=vmm,
        vmm_version="8.2.2" if vmm == "qemu" else "1.7.0",
        machine="pc-q35-8.2" if vmm == "qemu" else "microvm",
        cpu_model="max",
        accelerators=accelerators,
        vcpus=2,
        memory_mib=IMAGE_SIZE >> 20,
        kernel_digest=None,
        agent_protocol=1,
    )


@dataclass
class Seeded:
    hub: HubServer
    digests: dict[str, str]


def shoot(page: Any, name: str) -> None:
    """A full-page screenshot into artifacts/ui/ (gitignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
