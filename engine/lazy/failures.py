"""What a lazy server recorded against a child that died of a failed read (a chunk the
hub could not serve, or one that failed verification): read by the engine when it
reports the child (no FUSE import here: every engine command may call it)."""

from __future__ import annotations

import json
from pathlib import Path

from forkd.engine.lazy.paths import FILE_NAME, server_dir_of


def failure_of(memory: str, pid: int) -> str | None:
    """The failed read recorded for the QEMU ``pid`` whose memory image is ``memory``, when
    that image is a lazy server's file; else None."""
    d = server_dir_of(Path(memory))
    if d is None:
        return None
    try:
        errors = json.loads((d / "errors.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(errors, dict):
        return None
    found = errors.get(str(pid))
    return str(found) if found else None


__all__ = ["FILE_NAME", "failure_of"]
