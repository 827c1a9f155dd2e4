"""Review of forkd.ray across hosts, round 1: what forkd adds on top of Ray (which trusts
every job in its cluster) when a node's name, a spawn or a handle is not what it seems.

- Node names. ``forkd_node:NAME`` was any text Ray took: a node named after another
  node's Ray id was what ``nodes([that id])`` and ``fork_on(that id, ...)`` picked, so
  the sandboxes meant for one host went to another; a name with a newline forged a line
  of ``ClusterSpawnError`` ("node a: ..."), one with ESC drove the reader's terminal, and
  300 characters came back in front of every error of its sandboxes. Now a name is 1-63
  of ``[A-Za-z0-9._-]`` and no other node's id, else ``nodes()`` refuses the table with
  the node's id and its name shown inert (``forkd.names.shown``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray
from conftest import teardown
from ray_cluster import START_S, LocalCluster, LocalNode

import forkd.ray
from forkd.errors import InvalidInput

SLOTS = {"a": 2, "b": 2}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two forkd nodes (no snapshot, no hub: nothing here starts a VM); the driver connected."""
    local = LocalCluster.create(SLOTS)
    try:
        local.start()
        local.connect()
        yield local
    finally:
        teardown(local)


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

