"""The controller against the twelfth hostile review. No VM: the real MCP tools on the
real in-process backend, and a fake guest agent (daemon_support.FakeGuest)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from daemon_support import FakeGuest

from forkd.controller import mcp
from forkd.controller.sdk import Controller

MIB = 1 << 20


def _result_chars(result: object) -> int:
    """Characters of an MCP tool result as its client gets them (every content block)."""
    dumped = result.model_dump(mode="json", by_alias=True)  # type: ignore[attr-defined]
    return len(json.dumps(dumped))


# -- what a cell's result carries to the model -------------------------------------------
def test_a_run_code_result_is_bounded_whatever_the_guest_answers(
        place: Path, guest: FakeGuest) -> None:
    """Only stdout and stderr were bounded: the guest makes a cell's error, repr, value and
    rich results, and a result carries them twice (JSON text, structured content), so a
    45 MB answer was an 80 MB tool result in the model's context (130 MB at the agent's
    64 MiB line). Now they share mcp.MAX_CELL_CHARS, most useful first, and
    ``other_cut_chars`` says how much was left out."""
    big = "x" * (2 * MIB)
    png = base64.b64encode(b"\x89PNG" + b"\0" * (MIB + 1)).decode()
    guest.answer = {"stdout": "", "stderr": "", "value": [big], "repr": big,
                    "error": {"type": "E", "message": big, "traceback": big},
                    "results": [{"text": big, "html": big, "markdown": big, "svg": big,
                                 "latex": big, "json": [big], "png": png}] * 2}
    result = mcp.Tools(Controller(local=True)).run_code("sb-1", "1")
    assert _result_chars(result) < 12 * MIB  # 80 MB before
    cell = result.structured_content
    assert cell is not None
    assert cell["error"]["type"] == "E"
    assert cell["error"]["message"] == big  # the most useful part first, whole
    assert len(cell["error"]["traceback"]) == mcp.MAX_CELL_CHARS - 1 - len(big)
    assert cell["repr"] == "" and cell["value"] is None  # nothing was left for them
    assert all(r["png"] is None for r in cell["results"])  # an image fits whole or not at all
    assert not [c for c in result.content if c.type == "image"]
    listed = len(json.dumps([big]))
    assert cell["other_cut_chars"] == 1 + len(big) + listed + 2 * (5 * len(big) + listed
                                                                    + len(png))


def test_a_deeply_nested_value_is_not_indented_into_gigabytes(
        place: Path, guest: FakeGuest) -> None:
    """The result's text was the cell's JSON with ``indent=1``: each level of nesting adds
    a space to every line inside it, so a value 100 lists deep (600 KB as the guest sent
    it, well within the agent's bounds) became 60 MB of text in the MCP server (and the
    model's context); 8 MiB of such structure, gigabytes. The text is compact JSON now."""
    value: object = [0] * 200_000
    for _ in range(100):
        value = [value]
    guest.answer = {"stdout": "", "stderr": "", "value": value, "repr": "v", "error": None,
                    "results": []}
    result = mcp.Tools(Controller(local=True)).run_code("sb-1", "v")
    assert result.structured_content is not None
    assert result.structured_content["value"] == value  # it fits: given whole
    assert _result_chars(result) < 3 * len(json.dumps(value))


def test_a_value_too_deep_to_send_is_left_out(place: Path, guest: FakeGuest) -> None:
    """A value nested past 253 levels cannot be sent as a tool result (the MCP SDK's
    pydantic refuses it: the client got the JSON-RPC error "Circular reference detected
    (depth exceeded)", and none of the cell's output). Such a value (and a rich result's
    ``json``) past mcp.MAX_CELL_DEPTH is left out, counted in ``other_cut_chars``, and the
    rest of the result is sent."""
    value: object = [0]
    for _ in range(300):
        value = [value]
    guest.answer = {"stdout": "out", "stderr": "", "value": value, "repr": "deep",
                    "error": None, "results": [{"text": "t", "json": value}]}
    result = mcp.Tools(Controller(local=True)).run_code("sb-1", "v")
    result.model_dump_json(by_alias=True)  # what the transport does with it
    cell = result.structured_content
    assert cell is not None
    assert cell["value"] is None and cell["results"][0]["json"] is None
    assert cell["stdout"] == "out" and cell["repr"] == "deep"
    assert cell["other_cut_chars"] == 2 * len(json.dumps(value))
