"""Where a lazy server lives: ``$FORKD_HOME/lazy/<manifest hex>/`` (under the store, so
the children of its memory file count as the store's: children.of_store), its memory
file at ``mnt/memory.img``; its sockets in ``$FORKD_RUN/lazy/<hex[:16]>/`` (a unix
socket's path is at most 107 bytes), where the hex is of the server directory's path: two
stores that serve the same snapshot on one host (each has its own server) never share a
socket, so neither removes the other's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from forkd import digest as dg

LAZY_DIR = "lazy"
MOUNT_DIR = "mnt"
FILE_NAME = "memory.img"
PAGES_FILE = "pages.json"  # a recording server's pages (serve.py, record.py)


def server_dir(home: Path, head: str) -> Path:
    return home / LAZY_DIR / dg.hex_part(head)


def socket_dir(server: Path) -> Path:
    """The sockets' directory of the server in directory ``server`` (one per server
    directory; its server.lock makes one server at a time its owner)."""
    from forkd.engine.paths import run_dir

    key = hashlib.sha256(os.fsencode(server.resolve())).hexdigest()[:16]
    d = run_dir() / LAZY_DIR / key
    d.mkdir(parents=True, exist_ok=True)
    return d


def server_dir_of(memory: Path) -> Path | None:
    """The server directory of a lazy memory file's path, or None for any other path."""
    if memory.name != FILE_NAME or memory.parent.name != MOUNT_DIR:
        return None
    d = memory.parent.parent
    if d.parent.name != LAZY_DIR:
        return None
    return d
