"""A build interrupted mid-debootstrap (killed test, Ctrl-C) leaves /proc mounted in its chroot;
the next build of the same rootfs must clear it instead of failing with FileExistsError."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from forkd.engine import image

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def test_partial_rootfs_with_a_mount_inside_is_cleared(tmp_path: Path) -> None:
    base = tmp_path / "rootfs" / "0123456789abcdef"
    proc = base / "root" / "proc"
    proc.mkdir(parents=True)
    (base / "root" / "etc").mkdir()
    (base / "root" / "etc" / "os-release").write_text("partial\n")
    subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    try:
        assert image.mounts_below(base) == [proc]
        image.discard_partial(base)
        assert not base.exists()
        assert image.mounts_below(tmp_path) == []
    finally:
        subprocess.run(["umount", "-l", str(proc)], capture_output=True, check=False)


def test_mounts_below_ignores_a_sibling_with_the_same_prefix(tmp_path: Path) -> None:
    base = tmp_path / "abc"
    sibling = tmp_path / "abcd" / "proc"
    sibling.mkdir(parents=True)
    base.mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(sibling)], check=True)
    try:
        assert image.mounts_below(base) == []
        image.discard_partial(base)
        assert not base.exists()
        assert image.mounts_below(tmp_path / "abcd") == [sibling]
    finally:
        subprocess.run(["umount", "-l", str(sibling)], capture_output=True, check=False)
