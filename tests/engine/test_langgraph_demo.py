"""The langgraph-react branch demo on real VMs (TCG here), with the stand-in model reached
through each child's egress proxy: a source runs the ReAct loop's first steps, is branched,
and three grandchildren continue it with three steering hints."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from forkd.controller import langgraph_demo as lg
from forkd.store.store import Store

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "langgraph-react" / "recipe.toml"
TAG = "langgraph-react:test"


@pytest.fixture(scope="module")
def langgraph_react(store: Store) -> str:
    """The recipe built once (cached by its content in $FORKD_CACHE across runs)."""
    if os.geteuid() != 0:
        pytest.skip("VM tests need root (debootstrap, cgroups, netns)")
    from forkd.engine import recipe
    from forkd.engine.build import build

    build(store, recipe.load(RECIPE), TAG)
    return TAG


@pytest.mark.timeout(3600)  # builds the recipe into the session's store first (zstd 19, TCG)
def test_branch_mid_reasoning_three_hints(
    store: Store, langgraph_react: str, cleanup_children: None
) -> None:
    from forkd.engine import children as ch
    from forkd.errors import NotFound

    said: list[str] = []
    with tempfile.TemporaryDirectory(prefix="forkd-lg-test-") as tmp, \
            lg.standin_endpoint(Path(tmp)) as (endpoint, server):
        report = lg.run(store, endpoint, langgraph_react, say=said.append, server=server)
        requests = server.completions()
    assert report.problems == [], report.problems

    # the source ran two ReAct steps in its own memory: attractions, then the weather
    pre = report.source_messages
    assert [m["role"] for m in pre] == ["system", "user", "assistant", "tool", "assistant",
                                        "tool"]
    assert pre[5]["content"] == "Kyoto day 1: sunny, 24 C"
    # every grandchild's history up to the branch is the source's, message for message
    assert [lane.hint for lane in report.lanes] == list(lg.HINTS)
    for lane in report.lanes:
        assert lane.messages[: len(pre)] == pre
        assert lane.messages[len(pre)] == {"role": "user",
                                           "content": f"Steering hint: {lane.hint}"}
    # the model saw each pre-branch call once (from the source), then only steered calls
    unsteered = [r for r in requests if not any(
        "Steering hint" in str(m.get("content")) for m in r.body["messages"])]
    assert len(unsteered) == lg.PRE_BRANCH_STEPS
    assert len(requests) == lg.PRE_BRANCH_STEPS + sum(lane.model_calls for lane in report.lanes)
    assert [lane.model_calls for lane in report.lanes] == [2, 1, 2]
    # ... through the proxy, which put the real key in; the guest held a placeholder
    assert all(r.headers["authorization"].startswith("Bearer sk-standin-") for r in requests)
    # three different continuations, each built on the forecast fetched before the branch
    plans = {lane.hint: lane.answer for lane in report.lanes}
    assert len(set(plans.values())) == 3
    assert plans["deep culture"].startswith("Day one, deep culture")
    assert "Ryoan-ji rock garden" in plans["deep culture"]  # its own attractions call
    assert plans["minimalist"].startswith("Day one, minimalist")
    assert "$26 left for tickets" in plans["budget"]  # its own budget call, in its guest
    assert all("Weather: Kyoto day 1: sunny, 24 C" in p for p in plans.values())
    assert report.branch_pause_ms > 0 and all(lane.ready_ms > 0 for lane in report.lanes)
    # nothing of the demo is left: no sandbox, no branch tag
    ids = {report.source_id, *(lane.child_id for lane in report.lanes)}
    assert not ids & {c.id for c in ch.list_children()}
    with pytest.raises(NotFound):
        store.resolve(report.branch_tag)
    table = lg.side_by_side(report)
    assert "hint: deep culture" in table[0] and "hint: budget" in table[0]
