"""forkd.ray on a real two-node Ray cluster on this machine: fork 10 across both nodes,
exec in each from a Ray task on the other node, branch on "a" and push to the hub, fork
the branch on "b" (which pulls it), kill everything, and check nothing is left."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import ray
from conftest import SLOTS, gone
from hub_server import HubServer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray_cluster import LocalCluster

import forkd.ray
from forkd.errors import ForkdError, NotFound
from forkd.ray import ClusterSpawnError, RaySandbox

pytestmark = pytest.mark.vm

# the task below is sent by value: Ray's workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROBE = "cat /proc/sys/kernel/random/uuid; hostname"


@ray.remote(num_cpus=0)
def probe(sb: RaySandbox) -> tuple[str, str]:
    """Run in a Ray task: which node it ran on, and what the sandbox answered."""
    out = sb.commands.run(PROBE)
    assert out.exit_code == 0, out.stderr
    return ray.get_runtime_context().get_node_id(), out.stdout


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def test_a_node_whose_controller_is_down_fails_clearly_and_comes_back(
    cluster: LocalCluster, base_ref: str
):
    sb = forkd.ray.fork_on("b", base_ref, pull=True)
    node_b = cluster.nodes[1]
    node_b.stop_serve()
    try:
        with pytest.raises(ForkdError, match=r"^node b: .*controller.*forkd serve"):
            sb.commands.run("true")
        with pytest.raises(ClusterSpawnError, match="node b") as refused:
            forkd.ray.spawn(base_ref, 2, pull=True)
        assert len(refused.value.errors) == 1
        left = json.loads(cluster.head.forkd("ls", "--json"))
        assert left == [], "a spawn that failed on one node left sandboxes on another"
        alone = forkd.ray.spawn(base_ref, 1, pull=True, on=["a"])  # without the node
        alone[0].kill()
    finally:
        node_b.start_serve()
    assert sb.commands.run("echo back").stdout == "back\n"  # the same handle, same agent
    sb.kill()


def test_fork_exec_branch_fork_elsewhere_kill(cluster: LocalCluster, base_ref: str, hub: HubServer):
    nodes = {node.name: node for node in forkd.ray.nodes()}
    assert {name: node.slots for name, node in nodes.items()} == SLOTS
    a, b = nodes["a"], nodes["b"]

    # 1. fork 10 across both nodes, in proportion to their free slots (7 and 5: 6 and 4)
    boxes = forkd.ray.spawn(base_ref, 10, pull=True)
    per_node = {name: [sb for sb in boxes if sb.node == name] for name in nodes}
    assert {name: len(sbs) for name, sbs in per_node.items()} == {"a": 6, "b": 4}
    assert {sb.node_id for sb in per_node["a"]} == {a.node_id}
    assert {sb.node_id for sb in per_node["b"]} == {b.node_id}
    assert len({sb.id for sb in boxes}) == 10
    infos = [sb.info for sb in boxes]  # what each one has on its host, checked after kill

    # 2. exec in each, from a Ray task on the other node (handles pickle and travel)
    assert pickle.loads(pickle.dumps(boxes[0])) == boxes[0]
    other = {a.node_id: b.node_id, b.node_id: a.node_id}
    answers = ray.get(
        [probe.options(scheduling_strategy=on_node(other[sb.node_id])).remote(sb) for sb in boxes]
    )
    for sb, (ran_on, _) in zip(boxes, answers, strict=True):
        assert ran_on == other[sb.node_id]
    uuids = [out.split()[0] for _, out in answers]
    assert len(set(uuids)) == 10, "every guest computed its own random value"

    # 3. branch on a, pushed to the hub: state written in the guest before the branch
    parent = per_node["a"][0]
    state = parent.commands.run("head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'").stdout
    assert len(state) == 32
    parent.files.write("/root/state", state)
    branch_ref = f"{hub.address}/ray/tiny:branch"
    branched = parent.branch("tiny:ray-branch", push=branch_ref)
    assert branched.ref == "tiny:ray-branch" and branched.depth >= 1

    # 4. fork the branch on b, which pulls it from the hub: the grandchild has the state
    child = forkd.ray.fork_on("b", branch_ref, pull=True)
    assert child.node == "b" and child.node_id == b.node_id
    assert child.files.read("/root/state").decode() == state
    assert child.eval("WARM['recipe']") == "tiny"
    infos.append(child.info)

    # 5. kill everything; nothing of theirs is left on either host
    for sb in [*boxes, child]:
        sb.kill()
    with pytest.raises(NotFound):
        boxes[0].commands.run("true")
    for node in cluster.nodes:
        assert json.loads(node.forkd("ls", "--json")) == []
    for info in infos:
        assert gone(info.dir), info.dir
        assert gone(info.cgroup), info.cgroup
        assert all(gone(path) for path in (info.cgroups or {}).values()), info.cgroups
        assert gone(Path("/run/netns") / info.netns if info.netns else None), info.netns
    cluster.stop()
    for node in cluster.nodes:
        assert not node.socket.exists(), "forkd serve left its socket"
    assert cluster.leftovers() == [], "QEMU, Ray or forkd processes of the nodes are left"
