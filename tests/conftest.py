"""Shared fixtures: a fresh store per test and small synthetic memory images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_support import registry  # noqa: F401  (fixture: a docker-registry)
from s3_support import moto_server  # noqa: F401  (a session fixture: a real S3 API server)

from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

IMAGE_SIZE = 8 << 20  # small enough to keep the unit tests fast, 2048 pages, 4 chunks


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "home"
    monkeypatch.setenv("FORKD_HOME", str(path))
    yield path


@pytest.fixture
def store(home: Path) -> Store:
    return Store.open(home)


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    """A base image and three successive diffs (5% of pages changed each)."""
    base = tmp_path / "base.mem"
    write_base(base, IMAGE_SIZE, seed=7)
    out = [base]
    for i in range(3):
        nxt = tmp_path / f"diff{i}.mem"
        write_diff(out[-1], nxt, share=0.05, seed=100 + i)
        out.append(nxt)
    return out


@pytest.fixture
def chain(store: Store, images: list[Path]) -> list[str]:
    """Tags base ← d1 ← d2 ← d3 imported into ``store``."""
    tags = ["base", "d1", "d2", "d3"]
    parent = None
    for tag, image in zip(tags, images, strict=True):
        store.import_layer(tag, memory=image, parent=parent)
        parent = tag
    return tags
