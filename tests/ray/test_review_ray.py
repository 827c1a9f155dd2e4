"""Review of forkd.ray across hosts, round 1: what forkd adds on top of Ray (which trusts
every job in its cluster) when a node's name, a spawn or a handle is not what it seems.

- Node names. ``forkd_node:NAME`` was any text Ray took: a node named after another
  node's Ray id was what ``nodes([that id])`` and ``fork_on(that id, ...)`` picked, so
  the sandboxes meant for one host went to another; a name with a newline forged a line
  of ``ClusterSpawnError`` ("node a: ..."), one with ESC drove the reader's terminal, and
  300 characters came back in front of every error of its sandboxes. Now a name is 1-63
  of ``[A-Za-z0-9._-]`` and no other node's id, else ``nodes()`` refuses the table with
  the node's id and its name shown inert (``forkd.names.shown``).
- A spawn's all or none. A node's agent failing with anything but a forkd error (here a
  malformed credentials file of that node: a TypeError in the pull) left ``spawn`` at
  once with the node's traceback (its host paths included), without waiting for the
  other nodes' calls or killing what they had started: those sandboxes ran on with no
  handle, for ever without a ``timeout``, and took their host's slots from every later
  spawn. Now any failure of a call is that node's failure (``cluster.unexpected``:
  ``node b: its forkd agent failed with TypeError: ...``, inert and at most 500
  characters of it), so the spawn waits for every node and kills what the others
  started, as for a forkd error.
- What a read returns. ``files.read`` held the whole guest file in the node's agent (one
  per host, shared by every sandbox and job there), then in Ray's object store and the
  caller: the guest decides what the file is, and a sparse file of gigabytes or a link to
  /dev/zero (4 GiB streamed) grew the agent without a bound, 256 reads at once. Now a
  read returns at most ``forkd.ray.node.MAX_READ`` (32 MiB, what one frame of the guest
  agent carries): past it InvalidInput, the transfer ended.
- The harness. tests/ray's nodes ran the `ray` and `forkd` first on PATH, not the
  interpreter's under test: the node agents (forkd/ray/node.py) and `forkd serve` that
  the tests exercised were another checkout's. Now each node runs Ray on
  ``sys.executable`` and `forkd` from its environment (``ray_cluster.BIN``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import ray
from conftest import SLOTS
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray_cluster import BIN, START_S, LocalCluster, LocalNode

import forkd.ray
from forkd.errors import InvalidInput
from forkd.ray import ClusterSpawnError
from forkd.ray.node import MAX_READ

pytestmark = pytest.mark.vm  # the cluster (conftest: hub, nodes a and b, the tiny snapshot)

# the task below is sent by value: Ray's workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
def forkd_file() -> str:
    """Where the forkd package a Ray worker of a node imports comes from."""
    import forkd

    return str(forkd.__file__)


def forkd_nodes_in_ray() -> int:
    """Alive Ray nodes that declare forkd_slots (whatever their names)."""
    return sum(1 for n in ray.nodes() if n.get("Alive") and "forkd_slots" in n["Resources"])


def wait_for(count: int, what: str) -> None:
    deadline = time.monotonic() + START_S
    while forkd_nodes_in_ray() != count:
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def joined(cluster: LocalCluster, name: str, dirname: str) -> LocalNode:
    """A further forkd node named ``name`` (its `ray start` declares forkd_node:NAME)."""
    node = LocalNode(name, 1, cluster.base / dirname)
    node.dir.mkdir()
    cluster.nodes.append(node)
    node.start_ray(cluster.address)
    wait_for(len(SLOTS) + 1, f"the node {dirname} did not join")
    return node


def left(node: LocalNode) -> None:
    node.stop()
    wait_for(len(SLOTS), f"the node {node.dir.name} did not leave")


def test_a_node_named_after_another_nodes_id_is_refused(cluster: LocalCluster) -> None:
    """Before: a node whose ``forkd_node:NAME`` was node b's Ray id was what
    ``nodes([b's id])`` (and so ``fork_on(b's id, ...)``) picked: b's sandboxes went to it."""
    b = {n.name: n for n in forkd.ray.nodes()}["b"]
    node = joined(cluster, b.node_id, "c")
    try:
        with pytest.raises(InvalidInput, match=f"named after Ray node {b.node_id}"):
            forkd.ray.nodes([b.node_id])
    finally:
        left(node)


@pytest.mark.parametrize("name", ["x\nnode a: 0 of 2 slots free", "\x1b[2Jb", "é" * 300])
def test_a_node_with_a_hostile_name_is_refused_and_shown_inert(
    cluster: LocalCluster, name: str
) -> None:
    """Before: any text was a node's name, in front of every error of its sandboxes and in
    every ClusterSpawnError line: a newline forged another node's line, ESC drove the
    reader's terminal, 300 characters came back in each message."""
    node = joined(cluster, name, f"d{len(cluster.nodes)}")
    try:
        with pytest.raises(InvalidInput, match="is named") as refused:
            forkd.ray.nodes()
        message = str(refused.value)
        assert "\n" not in message and "\x1b" not in message and name not in message
        assert len(message) < 400
    finally:
        left(node)



def test_a_node_failing_oddly_leaves_no_sandbox_on_the_others(
    cluster: LocalCluster, base_ref: str
) -> None:
    """Before: a failure of one node's agent that was not a forkd error (here its
    credentials file made a directory: an IsADirectoryError) left ``spawn`` at once with the
    node's traceback, without waiting for the other nodes' calls or killing what they
    started: those sandboxes ran with no handle, for ever without a timeout, counted
    against their host's slots."""
    creds = cluster.nodes[1].dir / "client" / "credentials.json"
    saved = creds.read_bytes()
    creds.unlink()
    creds.mkdir()
    try:
        with pytest.raises(ClusterSpawnError) as refused:
            forkd.ray.spawn(base_ref, 2, pull=True)  # one on a, one on b
    finally:
        creds.rmdir()
        creds.write_bytes(saved)
    (line,) = refused.value.errors
    assert line.startswith("node b: its forkd agent failed with IsADirectoryError: ")
    assert "Traceback" not in line and len(line) < 1000
    assert json.loads(cluster.head.forkd("ls", "--json")) == [], "a's sandbox was left running"
    assert forkd.ray.fork_on("b", base_ref, pull=True).kill() is None  # b is fine again


def test_the_nodes_run_the_code_under_test(cluster: LocalCluster) -> None:
    """Before: the nodes' `ray start` and `forkd serve` were the first on PATH (here another
    checkout's), so the agents every test of tests/ray exercised were not the code under
    test: a fix of forkd/ray/node.py was never run, a test of it could not fail."""
    for node in forkd.ray.nodes():
        on_it = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        assert ray.get(forkd_file.options(scheduling_strategy=on_it).remote()) == forkd.__file__
    for local in cluster.nodes[: len(SLOTS)]:  # a and b (the named ones only ran Ray)
        assert local.serve is not None
        cmdline = Path(f"/proc/{local.serve.pid}/cmdline").read_bytes().split(b"\0")
        assert any(arg.startswith(str(BIN).encode()) for arg in cmdline), cmdline


def test_a_guest_file_read_through_ray_is_bounded(cluster: LocalCluster, base_ref: str) -> None:
    """Before: ``files.read`` held the whole file in the node's agent, then in Ray's object
    store and the caller: a guest that made the file a driver reads sparse and huge (or a
    link to /dev/zero: 4 GiB streamed) grew the agent that every sandbox of the host
    shares, 256 calls at once."""
    sb = forkd.ray.fork_on("a", base_ref, pull=True)
    try:
        made = sb.commands.run(
            f"truncate -s {MAX_READ + 1} /root/big && truncate -s {MAX_READ} /root/edge"
        )
        assert made.exit_code == 0, made.stderr
        with pytest.raises(InvalidInput, match=f"larger than {MAX_READ} bytes"):
            sb.files.read("/root/big")
        assert len(sb.files.read("/root/edge")) == MAX_READ
        assert sb.commands.run("echo alive").stdout == "alive\n"  # the same agent serves on
    finally:
        sb.kill()
