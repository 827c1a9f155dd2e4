"""forkd.service's privileges on a real sandbox: the daemon, started as systemd starts the
unit (root, the unit's CapabilityBoundingSet and nothing else), forks a child with its own
network namespace and cgroup limits, runs a command in it, and removes it all."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import DEPLOY, setpriv_bounded, unit_bounding_set

from forkd.store.store import Store

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available() or (None if shutil.which("setpriv") else "setpriv is missing")
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    return build(store, recipe.parse(text, src="tiny+network"), "tiny-net:deploy").ref


@pytest.fixture
def bounded_daemon(engine_env: dict[str, Path]) -> Iterator[tuple[Path, int]]:
    """`forkd serve` on a socket of its own, under forkd.service's bounding set."""
    from forkd.controller.client import RemoteBackend

    caps = unit_bounding_set(DEPLOY / "systemd" / "forkd.service")
    where = Path(tempfile.mkdtemp(prefix="forkd-deploy-"))  # short: a socket path
    sock = where / "controller.sock"
    log = (where / "serve.log").open("wb")
    daemon = subprocess.Popen(
        [*setpriv_bounded(caps), sys.executable, "-P", "-m", "forkd.cli", "serve",
         "--socket", str(sock)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (sock.exists() and RemoteBackend(socket=sock).alive()):
            assert daemon.poll() is None, (where / "serve.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not answer in 60 s"
            time.sleep(0.2)
        yield sock, daemon.pid
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
        log.close()
        shutil.rmtree(where, ignore_errors=True)


def _mask(caps: list[str]) -> int:
    """The kernel's bit mask of capability names (``net_admin`` → 1 << 12)."""
    out = subprocess.run(["setpriv", "--list-caps"], capture_output=True, text=True,
                         check=True).stdout.split()
    return sum(1 << out.index(c) for c in caps)


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_daemon_with_the_units_capabilities_forks_with_netns_and_limits(
    tiny_net: str, bounded_daemon: tuple[Path, int], cleanup_children: None
) -> None:
    from forkd.controller.api import ExecRequest, SpawnRequest
    from forkd.controller.client import RemoteBackend

    sock, daemon_pid = bounded_daemon
    caps = unit_bounding_set(DEPLOY / "systemd" / "forkd.service")
    assert int(_status(daemon_pid, "CapBnd"), 16) == _mask(caps), "setpriv did not bound it"
    backend = RemoteBackend(socket=sock, timeout=300)
    result = backend.spawn(SpawnRequest(tag=tiny_net, netns=True, memory_limit_mib=256,
                                        pids_max=256, cpus=1.0))
    assert result.errors == [] and len(result.sandboxes) == 1, result
    sandbox = result.sandboxes[0]
    try:
        assert sandbox.netns and (Path("/run/netns") / sandbox.netns).exists()
        assert sandbox.cgroups, "the limits made no cgroup"
        qemu_uid = int(_status(sandbox.pid, "Uid").split()[0])
        assert qemu_uid != 0, "QEMU kept root: -runas did not drop it"
        ran = backend.exec(sandbox.id, ExecRequest(argv=["ls", "/sys/class/net"]))
        assert ran.exit_code == 0 and set(ran.stdout.split()) - {"lo"}, ran  # its NIC
    finally:
        backend.kill(sandbox.id)
    assert not (Path("/run/netns") / sandbox.netns).exists()
    assert not any(Path(p).exists() for p in sandbox.cgroups.values())
    assert not os.path.exists(f"/proc/{sandbox.pid}") or _status(sandbox.pid, "State")[0] == "Z"
