"""Fixtures of the controller tests: an isolated FORKD_HOME/FORKD_RUN per test module, with
the module's TOKEN as the daemon's bearer token, and the tiny recipe built into it under
the module's TINY_TAG (the guest image itself is cached in $FORKD_CACHE)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import FakeGuest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("VM tests need root")
    base = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    values = {
        "FORKD_HOME": str(base / "home"),
        "FORKD_RUN": str(base / "run"),
        "FORKD_CONTROLLER_TOKEN": request.module.TOKEN,
    }
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        from forkd.engine import children as ch

        ch.kill_all()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tiny(request: pytest.FixtureRequest, env: dict[str, str]) -> str:
    tag: str = request.module.TINY_TAG
    proc = subprocess.run(
        ["forkd", "build", str(REPO / "recipes" / "tiny.toml"), "--tag", tag],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    return tag


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A FORKD_HOME and a short FORKD_RUN (sockets' paths fit 108 bytes) of this test."""
    short = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))  # sockets' paths fit 108 bytes
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(short / "run"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def guest(monkeypatch: pytest.MonkeyPatch) -> FakeGuest:
    """Every sandbox's agent, in this process, is a FakeGuest (and every sandbox exists)."""
    from forkd.controller.backend import LocalBackend
    from forkd.engine import children as ch

    fake = FakeGuest()
    monkeypatch.setattr(ch, "_agent", fake.agent)
    monkeypatch.setattr(LocalBackend, "sandbox", lambda self, sandbox_id: None)  # exists
    return fake
