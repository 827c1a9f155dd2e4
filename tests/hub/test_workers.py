"""`forkd hub serve --workers 2`: a pre-forked hub serves pushes and pulls and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from hub_server import free_port

from forkd.hub.settings import HubSettings
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store
from forkd.synthetic import write_base

SECRET = "workers-password-1"


def _children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


def test_two_workers_serve_and_stop(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": "admin", "FORKD_HUB_ADMIN_PASSWORD": SECRET}
    log = (tmp_path / "hub.log").open("wb")
    proc = subprocess.Popen(
        [
            "forkd",
            "hub",
            "serve",
            "--workers",
            "2",
            "--data",
            str(tmp_path / "data"),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env=env,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 401:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "hub.log"
            ).read_text()
            time.sleep(0.1)
        assert len(_children(proc.pid)) == 2
        store = Store(tmp_path / "home")
        write_base(tmp_path / "m.mem", 4 << 20, seed=5)
        store.import_layer("m", memory=tmp_path / "m.mem")
        hub = Hub(f"127.0.0.1:{port}", "http")
        with RegistryClient(hub, Credential("admin", SECRET)) as client:
            push(store, "m", parse_remote(f"{hub}/admin/m:v1"), client)
            other = Store(tmp_path / "other")
            got = pull(other, parse_remote(f"{hub}/admin/m:v1"), client)
        assert other.assemble(got.ref).memory.read_bytes() == (tmp_path / "m.mem").read_bytes()
        # The failed-login count is shared: the workers (each of these fresh connections
        # lands on either) refuse together once the limit is reached.
        url = f"http://127.0.0.1:{port}/token"
        limit = HubSettings(tmp_path).login_fail_limit
        for _ in range(limit):
            assert httpx.get(url, auth=("admin", "wrong-guess-1")).status_code == 401
        for _ in range(6):
            assert httpx.get(url, auth=("admin", "wrong-guess-2")).status_code == 429
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    assert proc.returncode == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)


def test_workers_refuse_background_sweeps(tmp_path: Path) -> None:
    config = tmp_path / "hub.toml"
    config.write_text("compact_deeper_than = 3\n")
    proc = subprocess.run(
        [
            "forkd",
            "hub",
            "serve",
            "--workers",
            "2",
            "--config",
            str(config),
            "--data",
            str(tmp_path / "data"),
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "gc --retention" in proc.stderr and "Traceback" not in proc.stderr
