"""`forkd quickstart` end to end with the tiny recipe, twice: the second run reuses everything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vm


def _quickstart(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [
            "forkd",
            "quickstart",
            "--yes",
            "--recipe",
            str(REPO / "recipes" / "tiny.toml"),
            "-n",
            "3",
            "--eval",
            "WARM['recipe'] + str(len(__import__('os').urandom(4)))",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr
    report: dict[str, object] = json.loads(proc.stdout)
    return report


def test_quickstart_twice(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("quickstart forks VMs: needs root")
    env = {
        **os.environ,
        "FORKD_HOME": str(tmp_path / "home"),
        "FORKD_RUN": str(tmp_path / "run"),
        "FORKD_CREDENTIALS": str(tmp_path / "credentials.json"),
    }
    env.pop("FORKD_HUB", None)
    state = tmp_path / "home" / "quickstart" / "hub" / "state.json"
    try:
        first = _quickstart(env)
        assert first["built"] is True and first["push_blobs"] > 0  # type: ignore[operator]
        children = first["children"]
        assert isinstance(children, list) and len(children) == 3
        assert {c["value"] for c in children} == {"tiny4"}
        catalog = str(first["catalog_url"])
        assert catalog.endswith("/forkd/tiny")
        page = httpx.get(catalog, timeout=10)  # browsable signed out: the pack is public
        assert page.status_code == 200 and "forkd pull" in page.text

        second = _quickstart(env)
        assert second["built"] is False and second["pulled_from_hub"] is False
        assert second["push_blobs"] == 0 and second["pull_blobs"] == 0
        assert second["hub"] == first["hub"]
        assert len(second["children"]) == 3  # type: ignore[arg-type]
        assert httpx.get(f"http://{first['hub']}/v2/", timeout=5).status_code in (200, 401)
        assert not list((tmp_path / "run" / "children").glob("tiny-*"))  # children killed
    finally:
        if state.exists():
            pid = json.loads(state.read_text())["pid"]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
