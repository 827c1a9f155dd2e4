"""A two-node Ray cluster of forkd nodes on this machine (head "a", worker "b", each with its
own FORKD_HOME/FORKD_RUN, `forkd serve` and forkd_slots), a hub both are logged in to, and
the tiny snapshot built on "a" and pushed there. Teardown kills only what these made and
checks nothing of theirs is left."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from hub_server import ADMIN, HubServer
from ray_cluster import REPO, LocalCluster

SLOTS = {"a": 7, "b": 5}  # 10 sandboxes split 6/4, and b keeps one slot for the grandchild
BASE_TAG = "tiny:ray"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(tmp_path_factory.mktemp("ray-hub")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(hub: HubServer) -> Iterator[LocalCluster]:
    """Both nodes up and joined; the driver (this process) connected."""
    if os.geteuid() != 0:
        pytest.skip("VM tests need root (debootstrap, cgroups, process_vm_readv)")
    local = LocalCluster.create(SLOTS)
    try:
        for node in local.nodes:
            node.forkd("login", hub.address, "--username", ADMIN[0],
                       "--password-stdin", stdin=ADMIN[1] + "\n", timeout=120)
        local.head.forkd("build", str(REPO / "recipes" / "tiny.toml"), "--tag", BASE_TAG)
        local.start()
        local.connect()
        yield local
    finally:
        teardown(local)


def teardown(local: LocalCluster) -> None:
    """Kill what is left of the nodes' sandboxes, stop Ray and the daemons, then anything
    that still mentions the nodes' directories; fail if something had to be killed."""
    for node in local.nodes:
        if node.socket.exists() or (node.dir / "home").exists():
            with suppress(AssertionError, subprocess.TimeoutExpired):
                node.forkd("kill", "--all", timeout=300)
    local.stop()
    left = local.leftovers()
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not left:
        local.remove()
    assert not left, f"processes of the Ray test nodes left behind: {left} (in {local.base})"


@pytest.fixture(scope="module")
def base_ref(cluster: LocalCluster, hub: HubServer) -> str:
    """The tiny snapshot built on "a", pushed to the hub (the one way packs move)."""
    ref = f"{hub.address}/ray/tiny:base"
    cluster.head.forkd("push", BASE_TAG, ref, timeout=600)
    return ref


def gone(path: str | Path | None) -> bool:
    return path is None or not Path(path).exists()
