"""How forkd.ray reads the Ray node table and splits N sandboxes over free slots (no Ray
needed: the table is ray.nodes()'s shape)."""

from __future__ import annotations

from typing import Any

import pytest

from forkd.errors import Conflict, InvalidInput
from forkd.ray.placement import ForkdNode, forkd_nodes, pick, split


def _node(node_id: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_only_alive_nodes_that_declare_slots_are_forkd_nodes() -> None:
    table = [
        _node("n1", forkd_slots=6, **{"forkd_node:a": 1}),
        _node("n2", forkd_slots=4),
        _node("n3"),  # no forkd_slots: not ours
        _node("n4", alive=False, forkd_slots=8, **{"forkd_node:dead": 1}),
    ]
    assert forkd_nodes(table) == [ForkdNode("n1", "a", 6), ForkdNode("n2", "n2", 4)]


def test_two_nodes_of_one_name_or_one_node_of_two_names_are_refused() -> None:
    with pytest.raises(InvalidInput, match="two Ray nodes are named 'a'"):
        forkd_nodes([_node(i, forkd_slots=1, **{"forkd_node:a": 1}) for i in ("n1", "n2")])
    with pytest.raises(InvalidInput, match="declares 2 names"):
        forkd_nodes([_node("n1", forkd_slots=1, **{"forkd_node:a": 1, "forkd_node:b": 1})])


def test_pick_by_name_or_id_and_says_what_exists() -> None:
    nodes = [ForkdNode("n1", "a", 6), ForkdNode("n2", "b", 4)]
    assert pick(nodes, ["b"]) == [nodes[1]]
    assert pick(nodes, ["n1", "a"]) == [nodes[0]]
    assert pick(nodes, None) == nodes
    with pytest.raises(InvalidInput, match="no forkd node 'c' in the Ray cluster; it has a, b"):
        pick(nodes, ["c"])
    with pytest.raises(InvalidInput, match="no Ray node declares forkd_slots"):
        pick([], None)


@pytest.mark.parametrize(
    ("n", "free", "plan"),
    [
        (10, {"a": 6, "b": 4}, {"a": 6, "b": 4}),
        (5, {"a": 6, "b": 4}, {"a": 3, "b": 2}),
        (1, {"a": 1, "b": 1}, {"a": 1, "b": 0}),  # a tie goes to the first name
        (3, {"a": 0, "b": 5}, {"a": 0, "b": 3}),
        (7, {"a": 3, "b": 3, "c": 3}, {"a": 3, "b": 2, "c": 2}),
        (2, {"a": 100, "b": 1}, {"a": 2, "b": 0}),
    ],
)
def test_split_is_proportional_to_free_slots(
    n: int, free: dict[str, int], plan: dict[str, int]
) -> None:
    assert split(n, free) == plan


def test_split_never_gives_a_node_more_than_it_has_free() -> None:
    for n in range(1, 40):
        for free in ({"a": 1, "b": 38}, {"a": 13, "b": 13, "c": 13}, {"a": 39}, {"a": 2, "b": 37}):
            plan = split(n, free)
            assert sum(plan.values()) == n
            assert all(plan[k] <= free[k] for k in free), (n, free, plan)


def test_split_refuses_more_than_the_free_slots_and_says_where() -> None:
    with pytest.raises(Conflict, match=r"11 sandboxes asked, 10 slots free \(a: 6, b: 4\)"):
        split(11, {"a": 6, "b": 4})
    with pytest.raises(InvalidInput, match="at least 1"):
        split(0, {"a": 6})
