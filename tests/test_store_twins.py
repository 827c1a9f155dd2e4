"""A second tag of the same layer (a twin, `forkd tag`) is not its twin's child (issue 15)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from forkd.errors import Conflict
from forkd.store.store import Store


def test_rmi_of_a_twin_is_not_refused(store: Store, chain: list[str]) -> None:
    store.tag("base-alias", "base")
    assert store.remove("base-alias") == ["base-alias:latest"]
    assert store.resolve("base") and store.resolve("d3")


def test_twin_of_a_child_is_removed_alone(store: Store, chain: list[str]) -> None:
    store.tag("d3-copy", "d3")
    assert store.remove("d3") == ["d3:latest"]  # d3-copy still names the layer
    assert sorted(i.ref for i in store.images()) == [
        "base:latest", "d1:latest", "d2:latest", "d3-copy:latest"
    ]


def test_cascade_on_a_twin_removes_only_the_twin(store: Store, chain: list[str]) -> None:
    store.tag("d1-alias", "d1")
    assert store.remove("d1-alias", cascade=True) == ["d1-alias:latest"]
    assert store.resolve("d2") and store.resolve("d3")


def test_last_name_of_a_parent_is_still_refused(store: Store, chain: list[str]) -> None:
    store.tag("base-alias", "base")
    store.remove("base")
    with pytest.raises(Conflict, match="base-alias:latest is the parent of d1:latest"):
        store.remove("base-alias")
    with pytest.raises(Conflict, match="the parent of"):
        store.remove("d1")  # a twin of base does not make d1 removable


def test_cli_rmi_alias(home: Path, store: Store, chain: list[str]) -> None:
    store.tag("base:v2", "base")
    proc = subprocess.run(
        ["forkd", "rmi", "base:v2", "--json"],
        env={**os.environ, "FORKD_HOME": str(home)},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"removed": ["base:v2"]}
