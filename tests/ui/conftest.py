"""Fixtures of the UI tests: a hub seeded through forkd's own store and push client, an
empty hub, and Debian's Chromium driven by Playwright."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ui_support import (
    ADMIN,
    ALICE,
    BOB,
    CHROMIUM,
    CHROMIUM_ARGS,
    IMAGE_SIZE,
    XSS_README,
    HubServer,
    Seeded,
    compat,
)

from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff


@pytest.fixture(scope="session")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    """alice/devbox (public): base ← d1 ← d2 plus `flat` compacted from d2, a README with
    an XSS attempt; acme/fc-tool (public, Firecracker, KVM only, one layer); alice/secret-lab
    (private). Everything goes through forkd's store and push client."""
    from forkd.registry.readme import set_readme

    root = tmp_path_factory.mktemp("ui")
    server = HubServer(root / "hub").start()
    try:
        server.add_user(*ALICE)
        server.add_user(*BOB)
        store = Store.open(root / "store")
        images = [root / "base.mem"]
        write_base(images[0], IMAGE_SIZE, seed=7)
        for i in range(2):
            images.append(root / f"d{i + 1}.mem")
            write_diff(images[-2], images[-1], share=0.05, seed=100 + i)
        qemu = compat("qemu", ["kvm", "tcg"])
        parent = None
        for tag, image in zip(["base", "d1", "d2"], images, strict=True):
            store.import_layer(
                tag, memory=image, parent=parent, compat=qemu, description=f"dev box {tag}"
            )
            parent = tag
        store.compact("d2", "flat")
        digests: dict[str, str] = {}
        for tag in ("base", "d1", "d2", "flat"):
            digests[tag] = server.push(store, tag, f"alice/devbox:{tag}", ALICE)
        server.cli("repo", "visibility", "alice/devbox", "public")
        with server.forkd_client(ALICE) as client:
            set_readme(client, "alice/devbox", XSS_README, "A warm Python dev box")
            for _ in range(3):
                client.get_manifest("alice/devbox", "d2")

        server.cli("org", "add", "acme", "--member", "alice=admin", "--member", "bob=pull")
        server.cli(
            "team",
            "add",
            "acme",
            "builders",
            "--role",
            "push",
            "--repositories",
            "acme/fc-*",
            "--member",
            "bob",
        )
        fc = root / "fc.mem"
        write_base(fc, IMAGE_SIZE, seed=11)
        store.import_layer("fc", memory=fc, compat=compat("firecracker", ["kvm"]))
        digests["fc"] = server.push(store, "fc", "acme/fc-tool:v1", ADMIN)
        server.cli("repo", "visibility", "acme/fc-tool", "public")
        secret = root / "secret.mem"
        write_base(secret, IMAGE_SIZE, seed=13)
        store.import_layer("secret", memory=secret, compat=qemu)
        digests["secret"] = server.push(store, "secret", "alice/secret-lab:v1", ALICE)
        yield Seeded(server, digests)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def empty_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(tmp_path_factory.mktemp("empty") / "hub").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium for one test module: Playwright's sync API holds an event loop on the main
    thread while it runs, so it stops before other modules (which may call asyncio.run)."""
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: apt-get install -y chromium")
        pytest.skip("Chromium not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    try:
        yield pg
    finally:
        context.close()
