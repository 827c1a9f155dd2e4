"""The driver's side of the Ray cluster: its forkd nodes and their agents (one each)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from forkd.errors import ForkdError
from forkd.names import inert
from forkd.ray.node import MAX_CALLS, NodeAgent
from forkd.ray.placement import ForkdNode, forkd_nodes, pick

NAMESPACE = "forkd"  # the Ray namespace of the agents, whatever the caller's job uses
T = TypeVar("T")
UNEXPECTED_SHOWN = 500  # characters of a node's unexpected error in its message


class NodeGone(ForkdError):
    """A node's agent cannot be reached: the node left the Ray cluster or its Ray died."""


def agent_name(node_id: str) -> str:
    return f"forkd-node-{node_id}"


def connected() -> None:
    if not ray.is_initialized():
        raise ForkdError(
            "forkd.ray needs a Ray cluster: call ray.init(address=...) first (each node "
            "started with `ray start --resources '{\"forkd_slots\": N}'`, docs/ray.md)"
        )


def nodes(wanted: Iterable[str] | None = None) -> list[ForkdNode]:
    """The cluster's alive forkd nodes (all, or those named in ``wanted``)."""
    connected()
    table: Callable[[], list[dict[str, Any]]] = ray.nodes  # untyped in Ray
    return pick(forkd_nodes(table()), wanted)


def agent(node: ForkdNode) -> Any:
    """The node's agent, started on it when it has none: detached, so it outlives the job
    that started it (as the sandboxes do), and found by name from any job or node."""
    actor = ray.remote(NodeAgent).options(
        name=agent_name(node.node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=MAX_CALLS,
        max_restarts=-1,  # restarted on its node (its sandboxes live in forkd serve, not here)
        max_task_retries=0,  # a call is never run twice (exec is not idempotent)
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
    )
    return actor.remote(node.name)


def agent_of(node_id: str, node_name: str) -> Any:
    """A running node's agent, by name (NodeGone when there is none)."""
    connected()
    try:
        return ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
    except ValueError:
        raise NodeGone(f"node {node_name} has no forkd agent in the Ray cluster: "
                       "the node left it, or its Ray was restarted") from None


def result(ref: Any, node_name: str) -> Any:
    """``ray.get`` of an agent's call: its forkd error as raised there, NodeGone when the
    agent (its node) died."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        if isinstance(exc.cause, ForkdError):
            raise exc.cause from None
        raise unexpected(node_name, exc.cause) from None
    except RayActorError as exc:  # died, or unavailable while Ray restarts it
        raise NodeGone(
            f"node {node_name}'s forkd agent is gone ({type(exc).__name__}): the node left "
            "the Ray cluster or its Ray processes died; its sandboxes may still run there "
            "(`forkd ls` on that host)"
        ) from exc


def unexpected(node_name: str, cause: object) -> ForkdError:
    """A failure of the agent that is not a forkd error (a broken file of its node, a bug):
    that node's failure, so a spawn still waits for the others and kills what they
    started, shown inert and short, not as the node's traceback."""
    return ForkdError(
        f"node {node_name}: its forkd agent failed with {type(cause).__name__}: "
        f"{inert(cause, UNEXPECTED_SHOWN)} (check that node's forkd setup: its FORKD_HOME, "
        "FORKD_CREDENTIALS and `forkd serve`)"
    )


def call(node_id: str, node_name: str, method: str, *args: Any) -> Any:
    handle = agent_of(node_id, node_name)
    return result(getattr(handle, method).remote(*args), node_name)


def each(calls: dict[str, Any], name_of: Callable[[str], str]) -> dict[str, Any | ForkdError]:
    """Wait for every call (keyed by node id); a failed call answers its error."""
    out: dict[str, Any | ForkdError] = {}
    for node_id, ref in calls.items():
        try:
            out[node_id] = result(ref, name_of(node_id))
        except ForkdError as exc:
            out[node_id] = exc
    return out
