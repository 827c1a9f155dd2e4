"""Which Ray nodes run forkd, and how N sandboxes are split over them.

A forkd node is a Ray node that declared ``forkd_slots`` (its sandbox capacity) when its
``ray start`` ran, optionally with a marker ``forkd_node:NAME`` that names it (docs/ray.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from forkd.errors import Conflict, InvalidInput
from forkd.names import matches, shown, whole

SLOTS = "forkd_slots"  # the custom resource: how many sandboxes the node may run at once
MARKER = "forkd_node:"  # + NAME: the node's name (a node without one is named by its id)
# A node's name, as a host name: it is in every error of its sandboxes and in `on=`.
NODE_NAME_RE = whole(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})")


@dataclass(frozen=True)
class ForkdNode:
    """A Ray node that runs `forkd serve`: its Ray node id, name and declared capacity."""

    node_id: str
    name: str
    slots: int


class NotFoundInCluster(InvalidInput):
    """The Ray cluster has no (such) forkd node."""


def forkd_nodes(ray_nodes: Iterable[Mapping[str, Any]]) -> list[ForkdNode]:
    """The alive nodes of ``ray.nodes()`` that declare forkd_slots, sorted by name."""
    found = []
    for entry in ray_nodes:
        resources = entry.get("Resources") or {}
        if not entry.get("Alive") or SLOTS not in resources:
            continue
        node_id = str(entry["NodeID"])
        names = [key[len(MARKER) :] for key in resources if key.startswith(MARKER)]
        if len(names) > 1:
            raise InvalidInput(
                f"Ray node {node_id} declares {len(names)} names ({', '.join(sorted(names))}): "
                f"give its `ray start --resources` one {MARKER}NAME"
            )
        found.append(ForkdNode(node_id, names[0] if names else node_id, int(resources[SLOTS])))
    ids = {node.node_id for node in found}
    for node in found:
        check_name(node, ids)
    taken: dict[str, str] = {}
    for node in found:
        if taken.setdefault(node.name, node.node_id) != node.node_id:
            raise InvalidInput(
                f"two Ray nodes are named {node.name!r} ({taken[node.name]} and "
                f"{node.node_id}): give each `ray start` its own {MARKER}NAME"
            )
    return sorted(found, key=lambda node: node.name)


def check_name(node: ForkdNode, ids: set[str]) -> None:
    """A node's own name is 1-63 of letters, digits, '.', '_' and '-' (it is in messages
    and terminals) and no other node's id (``on=[id]`` would pick it instead)."""
    if node.name == node.node_id:
        return
    if not matches(NODE_NAME_RE, node.name):
        raise InvalidInput(
            f"Ray node {node.node_id} is named {shown(node.name)}: a forkd node's name is "
            f"1-63 of A-Z, a-z, 0-9, '.', '_' and '-'; give its `ray start --resources` "
            f"another {MARKER}NAME"
        )
    if node.name in ids:
        raise InvalidInput(
            f"Ray node {node.node_id} is named after Ray node {node.name}: a name that is "
            f"another node's id would take that node's sandboxes; give its `ray start "
            f"--resources` another {MARKER}NAME"
        )


def pick(nodes: list[ForkdNode], wanted: Iterable[str] | None) -> list[ForkdNode]:
    """The nodes named (by name or Ray node id) in ``wanted``; all of them for None."""
    if not nodes:
        raise NotFoundInCluster(
            f"no Ray node declares {SLOTS}: start each host's Ray with "
            f"`ray start ... --resources '{{\"{SLOTS}\": N, \"{MARKER}NAME\": 1}}'` "
            "in the environment of its `forkd serve` (docs/ray.md)"
        )
    if wanted is None:
        return nodes
    chosen = []
    for key in wanted:
        match = [n for n in nodes if key in (n.name, n.node_id)]
        if not match:
            known = ", ".join(n.name for n in nodes)
            raise NotFoundInCluster(f"no forkd node {key!r} in the Ray cluster; it has {known}")
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def split(n: int, free: Mapping[str, int]) -> dict[str, int]:
    """``n`` sandboxes over the nodes in proportion to their free slots (largest remainder,
    ties to the first name), never more than a node has free. Conflict when the free slots
    add up to less than ``n``."""
    if n < 1:
        raise InvalidInput(f"n must be at least 1, got {n}")
    total = sum(max(0, f) for f in free.values())
    if total < n:
        shown = ", ".join(f"{name}: {f}" for name, f in sorted(free.items()))
        raise Conflict(
            f"{n} sandboxes asked, {total} slots free ({shown}): kill some, wait for them to "
            f"end, or add nodes (`ray start --resources '{{\"{SLOTS}\": N}}'`)"
        )
    share = {name: n * max(0, f) / total for name, f in free.items()}
    plan = {name: int(s) for name, s in share.items()}
    rest = n - sum(plan.values())
    for name in sorted(share, key=lambda k: (plan[k] - share[k], k))[:rest]:
        plan[name] += 1
    return plan
