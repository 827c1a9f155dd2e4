"""Debian's docker-registry (CNCF distribution 2.8) on a free loopback port, for interop tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from net_support import free_port

from forkd.registry.reference import Hub

REGISTRY = shutil.which("docker-registry")


def mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def start_registry(root: Path, auth: str = "") -> Iterator[Hub]:
    """Serve a registry with its storage under ``root`` until the generator is closed."""
    if REGISTRY is None:
        if os.environ.get("CI"):
            pytest.fail("docker-registry is missing: apt-get install -y docker-registry")
        pytest.skip("docker-registry not installed (scripts/install-deps.sh --test installs it)")
    port = free_port()
    mkdir(root)
    config = root / "config.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
        f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [REGISTRY, "serve", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"docker-registry did not start: {(root / 'registry.log').read_text()}"
            )
        time.sleep(0.05)
    try:
        yield Hub(f"127.0.0.1:{port}", "http")
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Hub]:
    yield from start_registry(tmp_path / "registry")
