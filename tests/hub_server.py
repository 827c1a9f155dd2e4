"""A real hub for tests: uvicorn on a free loopback port in a thread, administered through
the real `forkd hub` commands. Shared by tests/hub and tests/ui (a module of its own name,
so any test folder can import it)."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
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

from net_support import free_port  # noqa: E402 (hub tests import it from here)

from forkd.cli.hub_cmds import hub as hub_group  # noqa: E402
from forkd.hub import workers  # noqa: E402
from forkd.hub.app import create_app  # noqa: E402
from forkd.hub.settings import HubSettings  # noqa: E402
from forkd.registry.client import RegistryClient  # noqa: E402
from forkd.registry.credentials import Credential  # noqa: E402
from forkd.registry.reference import Hub, parse_remote  # noqa: E402
from forkd.registry.transfer import push  # noqa: E402
from forkd.store.store import Store  # noqa: E402

ADMIN = ("admin", "admin-password-1")
# Generous timeouts: the suite shares two cores with VM tests and benchmarks.
TIMEOUT = 120.0


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class HubServer:
    """A hub served by uvicorn in a background thread; ``stop`` is safe to call twice."""

    data_dir: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    # served as `forkd hub serve` serves it (workers.server_config: its bounded protocol)
    as_served: bool = False
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
            # Tests read refusals back from the audit log of a hub many tests share: the
            # per-minute bound is tested with its default where it applies (hostile 14).
            **{"audit_provoked_per_minute": 1_000_000, **self.overrides},
        )
        if self.as_served:
            config = workers.server_config(settings)  # host 127.0.0.1 by default
        else:
            config = uvicorn.Config(
                create_app(settings),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                proxy_headers=False,  # as `forkd hub serve` (hub/workers.py)
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
        # In a thread of its own: the command runs asyncio.run(), and Playwright's sync API
        # keeps an event loop on the main thread once a browser is up.
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(
                CliRunner().invoke, hub_group, argv, input=input, catch_exceptions=False
            ).result()
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

    @property
    def target(self) -> Hub:
        return Hub(self.address, "http")

    def forkd_client(self, who: tuple[str, str]) -> RegistryClient:
        """forkd's own registry client, logged in as ``who``."""
        return RegistryClient(self.target, Credential(*who))

    def push(self, store: Store, local: str, remote: str, who: tuple[str, str]) -> str:
        with self.forkd_client(who) as client:
            return push(store, local, parse_remote(f"{self.address}/{remote}"), client).digest
