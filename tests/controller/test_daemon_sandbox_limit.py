"""Hostile review, round 3: a caller could start VMs without end (512 per spawn, any number
of spawns, a pool of 256 for any number of tags). The daemon now admits a spawn, a pool
fill or a resume only while the VMs it runs (running sandboxes, pool targets and the ones
starting) stay within ``forkd serve --max-sandboxes``; past it the answer is a 409 saying
the limit and what to do.

The real app with a real LocalBackend and pool (no VM is started: the refused requests
never reach one, the admitted ones name a tag the store does not have). Counting running
sandboxes is tested against a live one in test_daemon_hostile_vm.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from litestar.testing import TestClient

from forkd.audit import AuditLog
from forkd.cli.controller_cmds import serve
from forkd.controller.app import ControllerMetrics, create_app
from forkd.controller.backend import LocalBackend
from forkd.engine.pool import Pool
from forkd.errors import InvalidInput
from forkd.store.store import Store

LIMIT = 3


@pytest.fixture
def limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[tuple[TestClient[Any], LocalBackend]]:
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    store = Store.open()
    backend = LocalBackend(store, Pool(store), max_sandboxes=LIMIT)
    app = create_app(backend, AuditLog(tmp_path / "audit.log"), ControllerMetrics(), None)
    try:
        with TestClient(app) as client:
            yield client, backend
    finally:
        backend.close()


def _over(answer: Any) -> None:
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["type"] == "Conflict" and f"its limit is {LIMIT}" in error["message"], error


def test_spawns_and_pools_past_the_limit_are_refused(
    limited: tuple[TestClient[Any], LocalBackend],
) -> None:
    http, backend = limited
    _over(http.post("/v1/sandboxes", json={"tag": "ghost", "n": LIMIT + 1}))
    _over(http.post("/v1/sandboxes", json={"tag": "ghost", "n": 2, "prewarm": 2}))
    _over(http.post("/v1/pools", json={"tag": "ghost", "k": LIMIT + 1}))
    for _ in range(3):  # admitted, then refused by the store: nothing stays counted
        assert http.post("/v1/sandboxes", json={"tag": "ghost", "n": LIMIT}).status_code == 404
        assert http.post("/v1/pools", json={"tag": "ghost", "k": LIMIT}).status_code == 404
    with backend._admitted(2, "a spawn in flight"):  # one still starting counts
        _over(http.post("/v1/sandboxes", json={"tag": "ghost", "n": 2}))
        assert http.post("/v1/sandboxes", json={"tag": "ghost", "n": 1}).status_code == 404
    answer = http.post("/v1/sandboxes", json={"tag": "ghost", "n": 10**30})
    assert answer.status_code == 400, answer.text  # a bad n is a 400, not the limit's 409


def test_the_limit_is_a_positive_integer(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="positive integer"):
        LocalBackend(Store.open(tmp_path / "home"), max_sandboxes=0)
    result = CliRunner().invoke(serve, ["--max-sandboxes", "0"])
    assert result.exit_code == 2 and "--max-sandboxes" in result.output, result.output
