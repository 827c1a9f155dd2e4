"""What `forkd build` puts in a pack (issue 11 item 2): no kernel or initramfs blobs (a fork
restores RAM and boots nothing), chunks at the strong zstd level, a slim root disk, bytes per
component in `forkd inspect --json`, and forks of such a pack work."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from forkd.pack import mediatypes as mt
from forkd.pack.chunking import ZSTD_LEVEL_FLAT, compress, decompress
from forkd.store.store import Store

pytestmark = pytest.mark.vm


def _val(r: dict[str, Any]) -> object:
    assert r["error"] is None, r["error"]
    return r["value"]


def _debugfs(image: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True, text=True,
                          check=True, stdin=subprocess.DEVNULL, timeout=60).stdout


def _names(image: Path, directory: str) -> set[str]:
    out = _debugfs(image, f"ls -p {directory}")
    return {f.split("/")[5] for f in out.splitlines() if f.count("/") >= 6} - {".", ".."}


def test_built_pack_has_no_kernel_blobs_and_components_add_up(store: Store, tiny: str) -> None:
    digest = store.resolve(tiny)
    m = store.manifest(digest)
    assert set(m.files) == {"vmstate"}  # no kernel, no initramfs
    assert not {mt.KERNEL, mt.INITRD} & {d.media_type for d in m.blobs()}
    compat = store.config(digest).compat
    assert compat is not None and compat.kernel_digest  # the kernel is named, not carried
    imap = store.image_map(m, "memory", tiny)
    assert imap is not None
    c = imap.chunks[0]
    blob = store.blobs.read(c.digest, c.stored)
    assert blob == compress(decompress(blob, c.size, "chunk"), ZSTD_LEVEL_FLAT)
    env = {**os.environ, "FORKD_HOME": str(store.home)}
    info = json.loads(subprocess.run(
        ["forkd", "inspect", "--json", tiny], env=env, capture_output=True, text=True,
        check=True, stdin=subprocess.DEVNULL, timeout=120).stdout)
    comps = info["components"]
    assert sum(v["stored_bytes"] for v in comps.values()) == info["stored_bytes"]
    assert comps["kernel"]["blobs"] == comps["initrd"]["blobs"] == 0
    assert comps["memory"]["stored_bytes"] > 0 and comps["disk"]["stored_bytes"] > 0
    assert comps["memory"]["logical_bytes"] == 160 << 20  # recipes/tiny.toml
    assert comps["memory"]["data_bytes"] < comps["memory"]["logical_bytes"]


def test_root_disk_is_slim(store: Store, tiny: str) -> None:
    disk = store.assemble(tiny).disk
    assert disk is not None
    assert _names(disk, "/usr/share/man") == set()
    assert _names(disk, "/var/lib/apt/lists") == set()
    assert _names(disk, "/usr/share/doc/bash") == {"copyright"}
    assert "forkd-slim" in _names(disk, "/etc/dpkg/dpkg.cfg.d")
    # bytecode only for what the template imported: the agent's modules, not e.g. imaplib
    cached = _names(disk, "/usr/lib/python3.11/__pycache__")
    assert {"ast.cpython-311.pyc", "socket.cpython-311.pyc"} <= cached
    assert not any(n.startswith("imaplib.") for n in cached)


def test_fork_of_the_slim_pack_runs_unimported_modules(
    store: Store, tiny: str, cleanup_children: None
) -> None:
    from forkd.engine import children as ch

    res = ch.fork(store, tiny, 1)
    assert not res.errors
    cid = res.children[0].id
    assert _val(ch.eval_in(cid, "WARM['ready']")) is True
    # a module without bytecode in the image is compiled on first import in the child
    r = ch.exec_in(cid, ["python3", "-c", "import imaplib, json; print(imaplib.__name__)"])
    assert (r["exit_code"], r["stdout"]) == (0, "imaplib\n"), r
    r = ch.exec_in(cid, ["sh", "-c", "ls /usr/lib/python3.11/__pycache__ | grep -c '^imaplib'"])
    assert r["stdout"].strip() == "1"  # written into this child's own disk
