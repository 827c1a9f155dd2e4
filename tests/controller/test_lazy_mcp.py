"""MCP create_sandboxes passes ``lazy`` to the spawn (no VM): the in-process backend
refuses a lazy spawn of a reference that names no hub, saying so, and the tool's schema
lists the parameter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from forkd import Controller
from forkd.errors import InvalidInput

mcp = pytest.importorskip("forkd.controller.mcp")


def test_create_sandboxes_takes_lazy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no default hub
    monkeypatch.delenv("FORKD_HUB", raising=False)
    tools = mcp.Tools(Controller(local=True))
    with pytest.raises(InvalidInput, match="lazy needs a hub reference"):
        tools.create_sandboxes("nohub/tiny:v1", lazy=True)
    server = mcp.build_server(Controller(local=True))
    (tool,) = [t for t in asyncio.run(server.list_tools()) if t.name == "create_sandboxes"]
    assert "lazy" in tool.input_schema["properties"]
