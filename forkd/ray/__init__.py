"""Sandboxes across hosts on Ray: ``forkd.ray.spawn(tag, n)`` places N sandboxes over a Ray
cluster whose nodes each run their own `forkd serve` and declare their capacity as the
custom resource ``forkd_slots`` (plus ``forkd_node:NAME``, the node's name) when their
``ray start`` runs. Ray only places work; each host keeps its own sandboxes, and packs
move between hosts only through the hub. docs/ray.md::

    ray.init(address="auto")
    boxes = forkd.ray.spawn("hub.example/team/py:base", 64, pull=True)
    outs = ray.get([rollout.remote(sb) for sb in boxes])   # handles work in any task
    boxes[0].branch("py:best", push="hub.example/team/py:best")
    more = forkd.ray.spawn("hub.example/team/py:best", 64, pull=True)
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress
from typing import Any

try:
    import ray  # noqa: F401  (forkd.ray is nothing without it)
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("forkd.ray needs Ray: pip install 'forkd[ray]'") from exc

from forkd.controller.sdk import SpawnError, spawn_request
from forkd.errors import ForkdError
from forkd.ray import cluster
from forkd.ray.cluster import NodeGone, nodes
from forkd.ray.placement import ForkdNode, split
from forkd.ray.sandbox import RaySandbox

__all__ = ["ClusterSpawnError", "ForkdNode", "NodeGone", "RaySandbox", "fork_on", "nodes", "spawn"]


class ClusterSpawnError(SpawnError):
    """Some nodes could not take their share (``.errors``: one line per node); nothing was
    left running: the sandboxes started on the other nodes were killed."""

    def __init__(self, asked: int, errors: list[str]) -> None:
        lines = "\n".join(errors[:5])
        ForkdError.__init__(
            self,
            f"{asked} sandboxes asked, {len(errors)} node(s) failed (the sandboxes started "
            f"on the others were killed):\n{lines}",
        )
        self.errors = errors


def spawn(
    tag: str,
    n: int,
    *,
    pull: bool = False,
    on: Iterable[str] | None = None,
    **options: Any,
) -> list[RaySandbox]:
    """Fork ``n`` sandboxes of ``tag`` over the cluster's forkd nodes (or the nodes named
    in ``on``, by name or Ray node id), in proportion to each node's free slots: its
    ``forkd_slots`` less the sandboxes running in its `forkd serve`. All or none: when one
    node fails, the sandboxes started on the others are killed and ClusterSpawnError (a
    SpawnError) says why.

    ``pull``: ``tag`` is a hub reference (``[HUB/]NS/NAME[:TAG]``) that each chosen node
    pulls first, with its own hub credentials (its local tag is ``NS/NAME:TAG``). Without
    it ``tag`` is a local tag that every chosen node must have. ``options``: the fields of
    the controller's SpawnRequest (``timeout``, ``memory_limit_mib``, ``netns``, ...)."""
    spawn_request(tag, n, options)  # bad options fail here, before any node is asked
    chosen = {node.node_id: node for node in nodes(on)}
    agents = {node_id: cluster.agent(node) for node_id, node in chosen.items()}
    free = cluster.each(
        {node_id: a.free.remote(chosen[node_id].slots) for node_id, a in agents.items()},
        lambda node_id: chosen[node_id].name,
    )
    down = [f"{chosen[k].name}: {v}" for k, v in free.items() if isinstance(v, ForkdError)]
    if down:
        raise ClusterSpawnError(n, down)
    plan = split(n, {k: int(v) for k, v in free.items() if not isinstance(v, ForkdError)})
    calls = {
        node_id: agents[node_id].spawn.remote(tag, k, chosen[node_id].slots, options, pull)
        for node_id, k in plan.items()
        if k
    }
    answers = cluster.each(calls, lambda node_id: chosen[node_id].name)
    started = [
        RaySandbox(info.id, chosen[node_id].name, node_id)
        for node_id, infos in answers.items()
        if not isinstance(infos, ForkdError)
        for info in infos
    ]
    failed = [str(v) for v in answers.values() if isinstance(v, ForkdError)]
    if failed:
        for sb in started:
            with suppress(ForkdError):
                sb.kill()
        raise ClusterSpawnError(n, failed)
    return started


def fork_on(node: str, tag: str, *, pull: bool = False, **options: Any) -> RaySandbox:
    """One sandbox of ``tag`` on ``node`` (its name or Ray node id); as ``spawn``."""
    return spawn(tag, 1, pull=pull, on=[node], **options)[0]
