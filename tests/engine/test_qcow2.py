"""engine/qcow2.py: the empty overlay it writes is one QEMU's own tools accept, read through to
the backing and write into, and it matches what ``qemu-img create`` writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from forkd.engine import qcow2
from forkd.engine.errors import VMMError
from forkd.engine.qemu import create_overlay


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60, check=False)


def _info(path: Path) -> dict[str, object]:
    r = _run("qemu-img", "info", "-U", "--output=json", str(path))
    assert r.returncode == 0, r.stderr
    info: dict[str, object] = json.loads(r.stdout)
    return info


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    """A raw disk of 3 MiB + 1000 bytes: a pattern per MiB, a size that is no whole sector."""
    raw = tmp_path / "base.raw"
    raw.write_bytes(b"".join(bytes([0x11 * (i + 1)]) * (1 << 20) for i in range(3))
                    + b"\x44" * 1000)
    return raw


def test_a_file_backed_overlay_reads_through_and_takes_writes(backing: Path,
                                                              tmp_path: Path) -> None:
    overlay = tmp_path / "child.qcow2"
    create_overlay(overlay, backing, "raw")
    check = _run("qemu-img", "check", str(overlay))
    assert check.returncode == 0 and "No errors" in check.stdout, check.stdout + check.stderr
    info = _info(overlay)
    assert info["format"] == "qcow2" and info["backing-filename"] == str(backing)
    assert info["backing-filename-format"] == "raw"
    assert info["virtual-size"] == 3 * (1 << 20) + 1024  # whole sectors, as qemu-img makes
    same = _run("qemu-img", "compare", "-F", "raw", str(overlay), str(backing))
    assert same.returncode == 0, same.stdout + same.stderr  # every byte from the backing
    w = _run("qemu-io", "-f", "qcow2", "-c", "write -P 0x77 1M 64k", "-c", "read -P 0x77 1M 64k",
             "-c", "read -P 0x11 0 64k", "-c", "read -P 0x33 2M 64k", str(overlay))
    assert w.returncode == 0 and "failed" not in w.stdout + w.stderr, w.stdout + w.stderr
    assert _run("qemu-img", "check", str(overlay)).returncode == 0  # refcounts grown right
    diff = _run("qemu-img", "compare", "-F", "raw", str(overlay), str(backing))
    assert diff.returncode == 1 and "offset 1048576" in diff.stdout, diff.stdout
    assert backing.read_bytes()[1 << 20] == 0x22  # the backing untouched


@pytest.mark.parametrize("size", [1, 1000, 512 << 20, (512 << 20) + 1, 3 << 30, 1 << 44])
def test_it_writes_what_qemu_img_create_writes(tmp_path: Path, size: int) -> None:
    """The same header fields, refcounts and L1 table as qemu-img's, for sizes around the
    L1 table's steps: only qemu-img's optional feature name table is left out."""
    spec = f"nbd+unix:///disk?socket={tmp_path}/disk.nbd.sock"
    ours, theirs = tmp_path / "ours.qcow2", tmp_path / "theirs.qcow2"
    qcow2.write_empty(ours, spec, "raw", size)
    r = _run("qemu-img", "create", "-q", "-f", "qcow2", "-b", spec, "-F", "raw", "-u",
             str(theirs), str(size))
    assert r.returncode == 0, r.stderr
    a, b = _info(ours), _info(theirs)
    for key in ("virtual-size", "cluster-size", "backing-filename", "backing-filename-format",
                "format-specific"):
        assert a[key] == b[key], key
    mine, ref = ours.read_bytes(), theirs.read_bytes()
    assert len(mine) == len(ref)
    assert mine[:8] == ref[:8] and mine[16:72] == ref[16:72]  # all but the backing's offset
    assert mine[72:104] == ref[72:104]  # the v3 fields
    assert mine[qcow2.CLUSTER:] == ref[qcow2.CLUSTER:]  # refcount table, block, L1 table


def test_bad_overlays_are_refused_with_the_reason(tmp_path: Path, backing: Path) -> None:
    with pytest.raises(VMMError, match="needs the backing's size"):
        create_overlay(tmp_path / "a.qcow2", "nbd+unix:///disk?socket=/x", "raw")
    with pytest.raises(VMMError, match="1 to 1023 bytes"):
        create_overlay(tmp_path / "b.qcow2", "x" * 1024, "raw", 1 << 20)
    with pytest.raises(VMMError, match="not 0"):
        create_overlay(tmp_path / "c.qcow2", "nbd+unix:///disk?socket=/x", "raw", 0)
    with pytest.raises(VMMError, match="must be given"):
        create_overlay(tmp_path / "d.qcow2", backing, "qcow2")
    with pytest.raises(VMMError, match="No such file"):
        create_overlay(tmp_path / "e.qcow2", tmp_path / "missing.raw", "raw")
    with pytest.raises(VMMError, match="cannot create the overlay"):
        create_overlay(tmp_path / "no-dir" / "f.qcow2", backing, "raw")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.raw"]
