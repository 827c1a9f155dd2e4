"""A real Ray cluster of forkd nodes on this one machine, for tests/ray and bench/: each node
is a `forkd serve` and a `ray start --block` sharing one environment (its own FORKD_HOME,
FORKD_RUN, hub credentials and Ray temp dir, all under the node's directory), as on a
host of its own. Only our own processes are ever signalled (never `ray stop`, which stops
every Ray on the machine), and ``leftovers`` finds any process that still mentions a
node's directory (QEMU, Ray, forkd serve)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import net_support

REPO = Path(__file__).resolve().parents[2]
# Every node, the head's address and the driver are on this loopback address. Not
# 127.0.0.1 nor localhost: Ray replaces those by the host's own outside address.
NODE_IP = "127.0.0.2"
START_S = 120.0  # a `ray start` or `forkd serve` is up within this (2 shared cores)
# The nodes run the code under test: `forkd` from this interpreter's environment and Ray
# (its workers, so the node agents) on this interpreter, not whatever `forkd` and `ray`
# come first on PATH (another checkout's, whose agents would be what the tests exercised).
BIN = Path(sys.executable).parent
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    return net_support.free_port(NODE_IP)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment contains ``text``."""
    found = []
    needle = text.encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            seen = (p / "cmdline").read_bytes() + (p / "environ").read_bytes()
        except OSError:
            continue
        if state != "Z" and needle in seen:
            found.append(int(p.name))
    return found


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen[bytes] | None, grace: float) -> None:
    """SIGTERM the process (its own session: its group too), SIGKILL after ``grace``."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    _signal_group(proc, signal.SIGKILL)  # whatever of its session is left


@dataclass
class LocalNode:
    """One forkd node: ``dir`` holds everything it has (home, run, credentials, ray)."""

    name: str
    slots: int
    dir: Path
    serve: subprocess.Popen[bytes] | None = None
    ray: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FORKD_HOME": str(self.dir / "home"),
            "FORKD_RUN": str(self.dir / "run"),
            "FORKD_CREDENTIALS": str(self.dir / "client" / "credentials.json"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    @property
    def socket(self) -> Path:
        return self.dir / "run" / "controller.sock"

    def forkd(self, *args: str, stdin: str | None = None, timeout: float = 900) -> str:
        """Run the `forkd` command as this node's host would."""
        proc = subprocess.run(
            ["forkd", *args], env=self.env, input=stdin, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        assert proc.returncode == 0, f"forkd {' '.join(args)} on {self.name}: {proc.stderr}"
        return proc.stdout

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        path = self.dir / log
        self.logs.append(path)
        with path.open("ab") as out:
            return subprocess.Popen(
                argv, env=self.env, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start_serve(self) -> None:
        from forkd.controller.client import RemoteBackend

        self.serve = self._spawn(["forkd", "serve"], "serve.log")
        deadline = time.monotonic() + START_S
        probe = RemoteBackend(socket=self.socket)
        try:
            while not probe.alive():
                assert self.serve.poll() is None, f"forkd serve of {self.name} exited"
                assert time.monotonic() < deadline, f"forkd serve of {self.name} did not start"
                time.sleep(0.2)
        finally:
            probe.close()

    def stop_serve(self) -> None:
        """Stop this node's `forkd serve` only (its children live on, as on any host)."""
        _stop(self.serve, 60)
        self.serve = None

    def ray_argv(self, head: str | None, port: int) -> list[str]:
        """``ray start`` of this node: the head listens on ``port``, a worker joins ``head``."""
        resources = {"forkd_slots": self.slots, f"forkd_node:{self.name}": 1}
        argv = [
            *RAY, "start", "--block", f"--node-ip-address={NODE_IP}", "--num-cpus=1",
            f"--temp-dir={self.dir / 'ray'}", f"--resources={json.dumps(resources)}",
            "--object-store-memory=100000000", "--disable-usage-stats",
        ]
        if head is None:
            return [*argv, "--head", f"--port={port}", "--include-dashboard=false"]
        return [*argv, f"--address={head}"]

    def start_ray(self, head: str | None, port: int = 0) -> None:
        self.ray = self._spawn(self.ray_argv(head, port), "ray.log")

    def stop(self) -> None:
        """Ray first (its agent holds the socket's connection), then forkd serve, which
        drains what it has. Safe to call twice."""
        _stop(self.ray, 60)
        _stop(self.serve, 60)
        self.ray = self.serve = None

    def leftovers(self) -> list[int]:
        return processes_mentioning(str(self.dir))


@dataclass
class LocalCluster:
    """A head (the first node) and workers, all on NODE_IP; ``connect`` is the driver."""

    nodes: list[LocalNode]
    base: Path
    port: int = field(default_factory=free_port)  # the head's GCS

    @classmethod
    def create(cls, slots: dict[str, int]) -> LocalCluster:
        # short: Ray's Unix sockets live under each node's temp dir (107-byte path limit)
        base = Path(tempfile.mkdtemp(prefix="forkd-ray-", dir="/tmp"))
        nodes = [LocalNode(name, k, base / name) for name, k in slots.items()]
        for node in nodes:
            node.dir.mkdir()
        return cls(nodes, base)

    @property
    def head(self) -> LocalNode:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{NODE_IP}:{self.port}"

    def start(self, nodes: int | None = None) -> None:
        """forkd serve on every node, then Ray on the first ``nodes`` (default all)."""
        for node in self.nodes:
            if node.serve is None:
                node.start_serve()
        for i, node in enumerate(self.nodes[: nodes or len(self.nodes)]):
            if node.ray is None:
                node.start_ray(None if i == 0 else self.address, self.port)
                if i == 0:
                    self._wait_for_gcs()

    def _wait_for_gcs(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                socket.create_connection((NODE_IP, self.port), 1).close()
                return
            except OSError:
                assert self.head.ray is not None and self.head.ray.poll() is None, (
                    "ray start --head exited: " + (self.head.dir / "ray.log").read_text()[-2000:]
                )
                assert time.monotonic() < deadline, "the Ray head did not start"
                time.sleep(0.5)

    def connect(self, expect: int | None = None) -> None:
        """ray.init as a driver on this machine, then wait until ``expect`` forkd nodes
        (default all) are in the cluster."""
        import ray

        import forkd.ray

        # Ray puts the driver's working directory first on its workers' sys.path: in a
        # checkout, its forkd/ folder would shadow the installed package there.
        here = os.getcwd()
        os.chdir(self.base)
        try:
            ray.init(address=self.address, _node_ip_address=NODE_IP, log_to_driver=False)
        finally:
            os.chdir(here)
        want = expect or len(self.nodes)
        deadline = time.monotonic() + START_S
        while len(forkd.ray.nodes()) < want:
            assert time.monotonic() < deadline, f"fewer than {want} forkd nodes joined Ray"
            time.sleep(0.5)

    def stop(self) -> None:
        """Disconnect the driver, stop every node (workers first). Safe to call twice."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(self.nodes):
            node.stop()

    def leftovers(self) -> list[int]:
        return processes_mentioning(str(self.base))

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
