"""Fixtures for engine tests: an isolated store and run directory, a tiny warm snapshot
built once per session, and teardown that leaves no VM, cgroup or socket behind."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from spare_support import end_spares

from forkd.store.store import Store

REPO = Path(__file__).resolve().parents[2]

# `python -m pytest` puts the checkout first on sys.path, so `forkd` is the source folder
# forkd/ and the mapped subpackages (forkd.engine → engine/, forkd.cli → cli/) are not
# found there; let the package also search the checkout root, as the installed mapping does.
import forkd  # noqa: E402

if str(REPO) not in forkd.__path__:
    forkd.__path__.append(str(REPO))
TINY = REPO / "recipes" / "tiny.toml"
TAG = "tiny:test"


def qemu_pids_under(d: Path) -> list[int]:
    """QEMU processes whose command line mentions directory d."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
            stat = (p / "stat").read_text()
        except OSError:
            continue
        zombie = stat.rsplit(")", 1)[1].split()[0] == "Z"
        if b"qemu-system" in cmd and str(d).encode() in cmd and not zombie:
            out.append(int(p.name))
    return out


def lazy_mounts_under(d: Path, wait: float = 15.0) -> list[str]:
    """forkd's lazy FUSE mounts (fsname forkd-lazy) below d, once their servers had
    ``wait`` seconds to see their last child go and unmount."""
    deadline = time.monotonic() + wait
    while True:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            found = [line.split()[1] for line in f
                     if line.startswith("forkd-lazy ") and line.split()[1].startswith(str(d))]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.fixture(scope="session")
def lazy_mounts() -> Callable[..., list[str]]:
    return lazy_mounts_under


@pytest.fixture(scope="session")
def qemu_pids() -> Callable[[Path], list[int]]:
    return qemu_pids_under


@pytest.fixture(scope="session")
def tiny_recipe() -> Path:
    return TINY


@pytest.fixture(scope="session")
def engine_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    base = tmp_path_factory.mktemp("engine")
    env = {"FORKD_HOME": base / "home", "FORKD_RUN": base / "run"}
    old = {k: os.environ.get(k) for k in env}
    for k, path in env.items():
        os.environ[k] = str(path)
    try:
        yield env
    finally:
        from forkd.engine import children as ch

        ch.kill_all()
        spares = end_spares(env["FORKD_RUN"])  # each lazy fork leaves one for the next
        leftovers = qemu_pids_under(env["FORKD_RUN"])
        mounts = lazy_mounts_under(base)
        for k, value in old.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value
        assert not leftovers, f"QEMU processes left behind: {leftovers}"
        assert not mounts, f"lazy FUSE mounts left behind: {mounts}"
        assert not spares, f"spare lazy servers left behind: {spares}"


@pytest.fixture(scope="session")
def store(engine_env: dict[str, Path]) -> Store:
    return Store.open(engine_env["FORKD_HOME"])


@pytest.fixture(scope="session")
def tiny(store: Store) -> str:
    """Build the tiny recipe once (the guest image itself is cached in $FORKD_CACHE)."""
    if os.geteuid() != 0:
        pytest.skip("VM tests need root (debootstrap, cgroups, process_vm_readv)")
    from forkd.engine import recipe
    from forkd.engine.build import build

    res = build(store, recipe.load(TINY), TAG)
    assert res.ref == TAG
    return TAG


@pytest.fixture
def cleanup_children(engine_env: dict[str, Path]) -> Iterator[None]:
    yield
    from forkd.engine import children as ch

    ch.kill_all()
