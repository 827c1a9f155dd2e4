"""Hub replicas for tests (and bench/hub_replicas.py): three `forkd hub serve` processes,
each with its own data directory, sharing one PostgreSQL database and one S3 bucket (a
moto server), behind HAProxy (Debian's `haproxy`) balancing round-robin with health
checks on /healthz.

``replicas`` (one set per test module) and ``fresh_replicas`` (one per test, for tests
that kill a replica) start everything on free loopback ports and stop it afterwards,
checking that no process of theirs is left and no port still answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hub_server import ADMIN, TIMEOUT, free_port
from s3_support import MOTO_CREDENTIALS, MotoServer

from forkd.cli.hub_cmds import hub as hub_group

REPLICAS = 3
START_TIMEOUT = 180.0  # three hubs importing and migrating at once on two busy cores
S3_PREFIX = "hub"
# HAProxy probes every replica's /healthz this often and takes one out after FALL
# failed probes, so a killed replica leaves the rotation within about INTER * FALL.
CHECK_INTER_MS = 300
CHECK_FALL = 2


def haproxy_config(port: int, servers: list[int], stats: Path | None = None) -> str:
    """Round-robin over ``servers`` with health checks; a request whose connection to a
    replica fails is sent to another one (``retries`` + ``option redispatch``). The same
    shape as the example in docs/hub.md ("Running several replicas")."""
    lines = [
        "global",
        "    maxconn 4096",
        *([f"    stats socket {stats} mode 600 level admin"] if stats else []),
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 120s",
        "    timeout server 120s",
        "    retries 3",
        "    option redispatch",
        "    option forwardfor",
        "frontend hub",
        f"    bind 127.0.0.1:{port}",
        "    default_backend replicas",
        "backend replicas",
        "    balance roundrobin",
        "    option httpchk GET /healthz",
        "    http-check expect status 200",
        f"    default-server inter {CHECK_INTER_MS}ms fall {CHECK_FALL} rise 1",
    ]
    lines += [f"    server r{i} 127.0.0.1:{p} check" for i, p in enumerate(servers)]
    return "\n".join(lines) + "\n"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Replica:
    data_dir: Path
    config: Path
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, "-P", "-c", "from forkd.cli.main import main; main()"]
        argv += ["hub", "serve", "--data", str(self.data_dir), "--config", str(self.config)]
        argv += ["--listen", self.address]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.address} exited:\n{self.log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.address} did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing flushed (a crash)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)

    def freeze(self) -> None:
        """SIGSTOP: requests sent to it hang (until ``kill``)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@dataclass
class ReplicaSet:
    """Three replicas and the HAProxy in front of them; ``url`` is the balancer's."""

    root: Path
    database_url: str
    moto: MotoServer
    bucket: str
    settings: dict[str, Any] = field(default_factory=dict)
    count: int = REPLICAS
    replicas: list[Replica] = field(default_factory=list)
    port: int = 0
    _haproxy: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def config_text(self) -> str:
        values: dict[str, Any] = {
            "database_url": self.database_url,
            "blob_backend": "s3",
            "s3_bucket": self.bucket,
            "s3_endpoint_url": self.moto.url,
            "s3_region": "us-east-1",
            "s3_prefix": S3_PREFIX,
            "s3_access_key_id": MOTO_CREDENTIALS["access_key_id"],
            "s3_secret_access_key": MOTO_CREDENTIALS["secret_access_key"],
            "admin_user": ADMIN[0],
            "admin_password": ADMIN[1],
            "trusted_proxies": "127.0.0.1",  # HAProxy's X-Forwarded-For names the client
            **self.settings,
        }
        return "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())

    def start(self) -> ReplicaSet:
        for i in range(self.count):
            data = self.root / f"replica{i}"
            data.mkdir(parents=True)
            config = data.parent / f"replica{i}.toml"
            config.write_text(self.config_text())
            self.replicas.append(Replica(data, config, free_port(), self.root / f"replica{i}.log"))
        for replica in self.replicas:  # all at once: they migrate and bootstrap together
            replica.start()
        deadline = time.monotonic() + START_TIMEOUT
        for replica in self.replicas:
            replica.wait_ready(deadline)
        self.port = free_port()
        cfg = self.root / "haproxy.cfg"
        ports = [r.port for r in self.replicas]
        cfg.write_text(haproxy_config(self.port, ports, self.root / "haproxy.sock"))
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        with open(self.root / "haproxy.log", "ab") as log:
            self._haproxy = subprocess.Popen(
                [haproxy, "-db", "-f", str(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_balanced(deadline)
        return self

    def wait_balanced(self, deadline: float) -> None:
        """Until HAProxy answers through a replica (servers start in rotation; one that
        fails its health checks leaves it)."""
        assert self._haproxy is not None
        while True:
            if self._haproxy.poll() is not None:
                raise RuntimeError(f"haproxy exited:\n{(self.root / 'haproxy.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("haproxy did not come up")
            time.sleep(0.1)

    def in_flight(self, replica: Replica) -> int:
        """Requests HAProxy has open on ``replica`` now (its stats socket's ``scur``)."""
        index = self.replicas.index(replica)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.root / "haproxy.sock"))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        for line in data.decode().splitlines():
            fields = line.split(",")
            if fields[:2] == ["replicas", f"r{index}"]:
                return int(fields[4] or 0)
        raise AssertionError(f"haproxy reports no server r{index}")

    def stop(self) -> None:
        procs = [r.proc for r in self.replicas if r.proc is not None]
        if self._haproxy is not None:
            procs.append(self._haproxy)
            self._haproxy.terminate()
            try:
                self._haproxy.wait(30)
            except subprocess.TimeoutExpired:
                self._haproxy.kill()
                self._haproxy.wait(30)
            self._haproxy = None
        for replica in self.replicas:
            replica.stop()
        left = [p.pid for p in procs if p.poll() is None]
        ports = [p for p in [self.port, *(r.port for r in self.replicas)] if p and _listening(p)]
        assert not left and not ports, f"left running: pids {left}, ports {ports}"

    # -- clients and administration -----------------------------------------------
    def client(self, auth: Any = None, via: Replica | None = None) -> httpx.Client:
        """An HTTP client of the balancer (or of one replica, ``via``)."""
        return httpx.Client(base_url=via.url if via else self.url, auth=auth, timeout=TIMEOUT)

    def cli(self, *args: str, input: str | None = None) -> str:
        """A `forkd hub` admin command on the shared database (replica 0's settings)."""
        leaf = 1 if args[0] in ("migrate", "serve", "gc") else 2
        first = self.replicas[0]
        argv = [*args[:leaf], "--data", str(first.data_dir), "--config", str(first.config)]
        argv += args[leaf:]
        with ThreadPoolExecutor(1) as pool:  # the command runs asyncio.run()
            result = pool.submit(
                CliRunner().invoke, hub_group, argv, input=input, catch_exceptions=False
            ).result()
        assert result.exit_code == 0, result.output
        return result.output

    def add_user(self, name: str) -> tuple[str, str]:
        password = f"{name}-password-1"
        self.cli("user", "add", name, "--password-stdin", input=password + "\n")
        return name, password

    def token(self, user: str, *scopes: str) -> str:
        argv = ["token", "create", "--user", user]
        for scope in scopes:
            argv += ["--scope", scope]
        return self.cli(*argv).strip()

    def objects(self) -> set[str]:
        pages = self.moto.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _haproxy_or_skip() -> None:
    if shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists():
        return
    if os.environ.get("CI"):
        pytest.fail("HAProxy is missing: apt-get install -y haproxy")
    pytest.skip("HAProxy not installed (apt-get install -y haproxy)")


def start_replicas(
    root: Path,
    postgres_server: Callable[[], str],
    moto: MotoServer,
    settings: dict[str, Any] | None = None,
    count: int = REPLICAS,
) -> ReplicaSet:
    _haproxy_or_skip()
    replicas = ReplicaSet(root, postgres_server(), moto, moto.new_bucket(), settings or {}, count)
    try:
        return replicas.start()
    except BaseException:
        replicas.stop()
        raise


# Small limits, so the tests reach them quickly.
TEST_SETTINGS = {"login_fail_limit": 5, "login_fail_window": 300.0}


@pytest.fixture(scope="module", name="replicas")
def replicas_fixture(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: Callable[[], str],
    moto_server: MotoServer,
) -> Iterator[ReplicaSet]:
    started = start_replicas(
        tmp_path_factory.mktemp("replicas"), postgres_server, moto_server, TEST_SETTINGS
    )
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(name="fresh_replicas")
def fresh_replicas_fixture(
    tmp_path: Path, postgres_server: Callable[[], str], moto_server: MotoServer
) -> Iterator[ReplicaSet]:
    started = start_replicas(tmp_path / "replicas", postgres_server, moto_server, TEST_SETTINGS)
    try:
        yield started
    finally:
        started.stop()
