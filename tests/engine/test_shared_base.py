"""The shared debootstrap base every recipe's rootfs starts from: cached by its key, rebuilt
when the key changes, built atomically (an interrupted build is never used). The debootstrap
itself is swapped for a stand-in that writes a marker file (a real one takes minutes; the
recipe build tests and the main job run it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.engine import image, recipe
from forkd.errors import ForkdError


class Interrupted(ForkdError):
    pass


@pytest.fixture
def debootstraps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """FORKD_CACHE in tmp_path; each stand-in debootstrap records its packages."""
    monkeypatch.setenv("FORKD_CACHE", str(tmp_path / "cache"))
    calls: list[list[str]] = []

    def fake(suite: str, mirror: str, root: Path, packages: list[str]) -> None:
        root.mkdir(parents=True)
        (root / "packages").write_text(" ".join(packages))
        calls.append(packages)

    monkeypatch.setattr(image, "_debootstrap", fake)
    return calls


def test_base_is_built_once_and_reused(debootstraps: list[list[str]]) -> None:
    root = image.shared_base("bookworm", "http://deb.debian.org/debian")
    assert (root / "packages").read_text() == "python3"
    assert image.shared_base("bookworm", "http://deb.debian.org/debian") == root
    assert debootstraps == [["python3"]]


def test_base_is_rebuilt_when_its_key_changes(debootstraps: list[list[str]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    first = image.shared_base("bookworm", "http://deb.debian.org/debian")
    other_suite = image.shared_base("trixie", "http://deb.debian.org/debian")
    other_mirror = image.shared_base("bookworm", "http://mirror.example/debian")
    monkeypatch.setattr(image, "BASE_PACKAGES", ("python3", "ca-certificates"))
    more = image.shared_base("bookworm", "http://deb.debian.org/debian")
    monkeypatch.setattr(image, "BASE_PACKAGES", ("python3",))
    monkeypatch.setattr(image, "BASE_LAYOUT", "next")
    relaid = image.shared_base("bookworm", "http://deb.debian.org/debian")
    assert len({first, other_suite, other_mirror, more, relaid}) == 5
    assert len(debootstraps) == 5 and debootstraps[3] == ["python3", "ca-certificates"]
    assert (first / "packages").read_text() == "python3"  # the old entry is left as it was


def test_interrupted_base_is_not_used(debootstraps: list[list[str]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = image._debootstrap

    def dies_halfway(suite: str, mirror: str, root: Path, packages: list[str]) -> None:
        root.mkdir(parents=True)
        (root / "half").write_text("written before the crash")
        raise Interrupted("debootstrap was killed")

    monkeypatch.setattr(image, "_debootstrap", dies_halfway)
    with pytest.raises(Interrupted):
        image.shared_base("bookworm", "http://deb.debian.org/debian")
    entry = image.cache_dir() / "base" / image.base_key("bookworm", "http://deb.debian.org/debian")
    assert not entry.exists()  # only the .partial directory holds the half-built tree
    monkeypatch.setattr(image, "_debootstrap", real)
    root = image.shared_base("bookworm", "http://deb.debian.org/debian")
    assert (root / "packages").read_text() == "python3" and not (root / "half").exists()
    assert not entry.with_name(entry.name + ".partial").exists()


def test_entry_without_its_marker_is_rebuilt(debootstraps: list[list[str]]) -> None:
    entry = image.cache_dir() / "base" / image.base_key("bookworm", "http://deb.debian.org/debian")
    (entry / "root").mkdir(parents=True)
    (entry / "root" / "stale").write_text("no ok marker: not trusted")
    root = image.shared_base("bookworm", "http://deb.debian.org/debian")
    assert not (root / "stale").exists() and (entry / "ok").is_file()
    assert len(debootstraps) == 1


def test_recipe_installs_only_what_the_base_lacks() -> None:
    r = recipe.parse('[recipe]\nname = "a"\n[packages]\napt = ["python3", "git", "git"]\n'
                     'pip = ["six==1.16.0"]\n')
    assert image.recipe_packages(r) == ["git", "python3-pip"]
    plain = recipe.parse('[recipe]\nname = "b"\n[packages]\napt = ["python3"]\n')
    assert image.recipe_packages(plain) == []


def test_rootfs_key_follows_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    r = recipe.parse('[recipe]\nname = "a"\n[packages]\napt = ["git"]\n')
    before = image._rootfs_key(r)
    monkeypatch.setattr(image, "BASE_LAYOUT", "next")
    assert image._rootfs_key(r) != before
