"""Where forkd keeps what a guest or a pusher would not show another local user is made
only its owner's: a store's home (snapshots' memory, with whatever the guests held in it:
an agent's keys, a session's data) and a hub's data directory (its SQLite database of
token and password hashes, private packs' blobs). Before, both were made mode 0755 and
every local user could read them. One made before, or chosen by the operator, is left as
it is, and `forkd doctor` (the store) and the hub's start (its data directory) say so."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.hub.services import Hub
from forkd.hub.settings import HubSettings
from forkd.store.store import Store


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_store_home_is_its_owners_only(tmp_path: Path) -> None:
    home = tmp_path / "a" / "home"
    Store(home)
    assert mode(home) == 0o700
    Store(home)  # opened again: as it is
    assert mode(home) == 0o700


def test_a_new_hub_data_directory_is_its_owners_only(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    Hub.build(HubSettings(data).validated())
    assert mode(data) == 0o700


def test_a_hub_data_directory_others_may_read_is_named_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "hub"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    with caplog.at_level(logging.WARNING, logger="forkd.hub"):
        Hub.build(HubSettings(data).validated())
    said = [r.getMessage() for r in caplog.records if str(data) in r.getMessage()]
    assert said and "mode 0755" in said[0] and "chmod 700" in said[0]
    assert mode(data) == 0o755  # the operator's directory is left as it is


def doctor_store_access(home: Path) -> dict[str, str]:
    env = {**os.environ, "FORKD_HOME": str(home), "FORKD_RUN": str(home.parent / "run")}
    out = subprocess.run([sys.executable, "-P", "-m", "forkd.cli", "doctor", "--json",
                          "--no-store"], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    return dict(checks["store-access"])


def test_doctor_warns_of_a_store_others_may_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    check = doctor_store_access(home)
    assert check["status"] == "warn" and "mode 0755" in check["detail"]
    assert check["hint"] == f"chmod 700 {home}"
    os.chmod(home, 0o700)
    assert doctor_store_access(home)["status"] == "ok"
