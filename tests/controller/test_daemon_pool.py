"""Prewarmed pools through the daemon: `forkd serve --prewarm`, /v1/pools, spawn prewarm=K,
and a daemon stop that leaves no QEMU, socket, cgroup or directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from net_support import free_port

from forkd.controller.api import PoolRequest, SpawnRequest
from forkd.controller.backend import LocalBackend
from forkd.errors import InvalidInput

REPO = Path(__file__).resolve().parents[2]
TOKEN = "pool-token-0123456789-0123456789-0123456789"  # >= 32 bytes
TAG = "tiny:pool"
TINY_TAG = TAG
pytestmark = pytest.mark.vm


def _qemu_pids(d: Path) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"qemu-system" in cmd and str(d).encode() in cmd and state != "Z":
            out.append(int(p.name))
    return out


def _until(what: str, check: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _pool(http: httpx.Client, tag: str = TAG) -> dict[str, Any]:
    pools = {p["tag"]: p for p in http.get("/v1/pools").json()}
    return pools.get(tag) or {"waiting": 0, "target": 0, "starting": 0}


def test_daemon_pool_round_trip_and_clean_stop(env: dict[str, str], tiny: str):
    run = Path(env["FORKD_RUN"])
    port = free_port()
    log_path = Path(env["FORKD_HOME"]) / "serve-pool.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["forkd", "serve", "--listen", f"127.0.0.1:{port}", "--prewarm", f"{TAG}=2"],
            env={**os.environ, **env},
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _until("forkd serve", up, 60)
        for method, path in (
            ("GET", "/v1/pools"),
            ("POST", "/v1/pools"),
            ("DELETE", f"/v1/pools/{TAG}"),
        ):
            assert httpx.request(method, url + path, json={}).status_code == 401  # token on TCP
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300
        ) as http:
            _until("the --prewarm pool", lambda: _pool(http)["waiting"] == 2)
            assert http.get("/v1/sandboxes").json() == []  # waiting processes are not sandboxes
            made = http.post("/v1/sandboxes", json={"tag": TAG, "n": 2, "prewarm": 3})
            assert made.status_code == 201, made.text
            boxes = made.json()["sandboxes"]
            assert all("prestarted_ms" in s["timings_ms"] for s in boxes)  # taken from the pool
            ids = [s["id"] for s in boxes]
            values = {
                http.post(
                    f"/v1/sandboxes/{i}/eval", json={"code": "import os; os.urandom(16).hex()"}
                ).json()["value"]
                for i in ids
            }
            assert len(values) == 2
            _until("the refill to 3", lambda: _pool(http)["waiting"] == 3)
            assert _pool(http)["target"] == 3
            assert {s["id"] for s in http.get("/v1/sandboxes").json()} == set(ids)
            # explicit management and bad input
            assert http.post("/v1/pools", json={"tag": TAG, "k": -1}).status_code == 400
            assert http.post("/v1/pools", json={"tag": TAG, "k": 10_000}).status_code == 400
            assert http.post("/v1/pools", json={"tag": "ghost:x", "k": 1}).status_code == 404
            assert http.delete("/v1/pools/ghost:x").status_code == 404
            bad = http.post("/v1/sandboxes", json={"tag": TAG, "prewarm": -2})
            assert bad.status_code == 400
            filled = http.post("/v1/pools", json={"tag": TAG, "k": 1, "wait": True})
            assert filled.status_code == 200, filled.text
            assert (filled.json()["target"], filled.json()["waiting"]) == (1, 1)
            assert http.delete(f"/v1/pools/{TAG}").json()["removed"] is True
            assert _pool(http)["target"] == 0
            assert (
                http.post("/v1/pools", json={"tag": TAG, "k": 2, "wait": True}).json()["waiting"]
                == 2
            )
            for i in ids:
                assert http.delete(f"/v1/sandboxes/{i}").status_code == 200
            # the SDK drives the same pools over REST
            from forkd import Controller

            ctl = Controller(url=url, token=TOKEN)
            ctl.prewarm(TAG, 2)
            assert [p.waiting for p in ctl.pools() if p.tag.startswith("tiny:pool")] == [2]
            boxes = ctl.spawn_sandboxes(TAG, 2, prewarm=1)
            try:
                assert len({b.eval("import os; os.urandom(8).hex()") for b in boxes}) == 2
            finally:
                for b in boxes:
                    b.kill()
        audit = Path(env["FORKD_HOME"], "controller-audit.log").read_text()
        assert '"action":"pool.fill"' in audit and '"action":"pool.delete"' in audit
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    # the daemon drained its pool: nothing of the waiting processes is left
    assert _qemu_pids(run) == []
    children = run / "children"
    assert [d.name for d in children.iterdir()] == [] if children.exists() else True
    assert not (run / "controller.sock").exists()
    cg = Path("/sys/fs/cgroup/memory/forkd")
    if cg.exists():
        assert not [d for d in cg.iterdir() if d.is_dir() and d.name.startswith("tiny-")]


def test_prewarm_needs_the_daemon(env: dict[str, str], tiny: str):
    backend = LocalBackend()
    with pytest.raises(InvalidInput, match="forkd serve"):
        backend.spawn(SpawnRequest(tag=TAG, n=1, prewarm=2))
    with pytest.raises(InvalidInput):
        backend.fill_pool(PoolRequest(tag=TAG, k=1))
    assert backend.pools() == []


def test_sdk_prewarm_needs_the_daemon(env: dict[str, str], tiny: str) -> None:
    from forkd import Controller
    from forkd.errors import ForkdError

    with pytest.raises(ForkdError, match="forkd serve"):
        Controller(local=True).prewarm(TAG, 1)
