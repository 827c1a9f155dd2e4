"""The root disk leaves out what no guest program reads (engine/image.py slim_rootfs)."""

from __future__ import annotations

import os
from pathlib import Path

from forkd.engine.image import DPKG_SLIM_CFG, LINK_MIN_BYTES, link_duplicates, slim_rootfs


def _put(root: Path, rel: str, data: bytes = b"x", mode: int = 0o644) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    p.chmod(mode)
    return p


def test_slim_removes_docs_indexes_tests_and_bytecode(tmp_path: Path) -> None:
    root = tmp_path / "root"
    keep = [
        "usr/share/doc/bash/copyright",
        "usr/lib/python3/dist-packages/numpy/core/multiarray.py",
        "usr/lib/python3/dist-packages/tests/__init__.py",  # a top-level package named tests
        "usr/lib/python3.11/json/__init__.py",
        "var/lib/dpkg/status",
        "usr/share/zoneinfo/UTC",
    ]
    gone = [
        "usr/share/doc/bash/README.gz",
        "usr/share/doc/bash/examples/x.sh",
        "usr/share/man/man1/bash.1.gz",
        "usr/share/info/bash.info.gz",
        "usr/share/locale/de/LC_MESSAGES/bash.mo",
        "usr/share/lintian/overrides/bash",
        "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages",
        "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease",
        "var/cache/apt/pkgcache.bin",
        "var/cache/debconf/templates.dat-old",
        "var/log/apt/term.log",
        "var/log/dpkg.log",
        "usr/lib/python3/dist-packages/numpy/tests/test_a.py",
        "usr/lib/python3/dist-packages/numpy/core/tests/test_b.py",
        "usr/lib/python3/dist-packages/numpy/core/__pycache__/multiarray.cpython-311.pyc",
        "usr/lib/python3.11/json/__pycache__/__init__.cpython-311.pyc",
        "usr/lib/python3.11/__pycache__/os.cpython-311.pyc",
    ]
    for rel in keep + gone:
        _put(root, rel)
    (root / "etc/dpkg/dpkg.cfg.d").mkdir(parents=True)
    slim_rootfs(root)
    for rel in keep:
        assert (root / rel).exists(), rel
    for rel in gone:
        assert not (root / rel).exists(), rel
    assert not (root / "usr/lib/python3/dist-packages/numpy/core/tests").exists()
    assert (root / "var/log/apt").is_dir()  # directories stay, their files go
    assert (root / "etc/dpkg/dpkg.cfg.d/forkd-slim").read_text() == DPKG_SLIM_CFG


def test_equal_files_are_linked_once(tmp_path: Path) -> None:
    big = os.urandom(LINK_MIN_BYTES)
    a = _put(tmp_path, "a/lib.so", big)
    b = _put(tmp_path, "b/lib.so", big)
    c = _put(tmp_path, "c/lib.so", big, mode=0o755)  # other mode: stays its own file
    d = _put(tmp_path, "d/other.so", os.urandom(LINK_MIN_BYTES))
    small = [_put(tmp_path, f"s{i}", b"same") for i in range(2)]  # under the threshold
    assert link_duplicates(tmp_path) == LINK_MIN_BYTES
    assert a.stat().st_ino == b.stat().st_ino and b.read_bytes() == big
    assert c.stat().st_ino != a.stat().st_ino
    assert d.stat().st_ino != a.stat().st_ino
    assert small[0].stat().st_ino != small[1].stat().st_ino
    assert link_duplicates(tmp_path) == 0  # already linked
