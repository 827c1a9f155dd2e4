"""Helpers of the UI tests: a real hub in a thread, seeding through forkd's own client,
screenshots. A module of its own name (not conftest) so test modules can import it
whatever other conftest.py files the run has loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hub_server import ADMIN, TIMEOUT, HubServer, free_port  # noqa: F401

from forkd.pack.config import Compat

ALICE = ("alice", "alice-password-1")
BOB = ("bob", "bob-password-1")
IMAGE_SIZE = 8 << 20
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "ui"
XSS_README = """# Dev box

A warm Python dev box. <script>window.__pwned = 1; alert("script")</script>

<img src=x onerror="window.__pwned = 2; alert('onerror')">

[click me](javascript:alert('link'))

| pages | state |
|-------|-------|
| 2048  | warm  |
"""


def compat(vmm: str, accelerators: list[str]) -> Compat:
    return Compat(
        vmm=vmm,
        vmm_version="8.2.2" if vmm == "qemu" else "1.7.0",
        machine="pc-q35-8.2" if vmm == "qemu" else "microvm",
        cpu_model="max",
        accelerators=accelerators,
        vcpus=2,
        memory_mib=IMAGE_SIZE >> 20,
        kernel_digest=None,
        agent_protocol=1,
    )


@dataclass
class Seeded:
    hub: HubServer
    digests: dict[str, str]


def shoot(page: Any, name: str) -> None:
    """A full-page screenshot into artifacts/ui/ (gitignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
