"""A memory-limited cgroup per child (v2 where the memory controller is there, else v1)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from forkd.engine.errors import HostError

CGROOT = Path("/sys/fs/cgroup")
PARENT = "forkd"


def detect() -> tuple[str, Path] | None:
    """("v2", root) or ("v1", memory mount), or None when no memory controller is usable."""
    ctl = CGROOT / "cgroup.controllers"
    if ctl.exists() and "memory" in ctl.read_text().split():
        return "v2", CGROOT
    v1 = CGROOT / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        return "v1", v1
    return None


class MemoryCgroup:
    """Create with a limit, add a pid, remove when the process is gone. remove() is idempotent."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, name: str, limit_mib: int) -> MemoryCgroup:
        found = detect()
        if found is None:
            raise HostError("no cgroup memory controller is mounted (v1 or v2); mount one or "
                            "fork without --memory-limit-mib")
        version, root = found
        parent = root / PARENT
        try:
            parent.mkdir(exist_ok=True)
            if version == "v2":
                with contextlib.suppress(OSError):
                    (root / "cgroup.subtree_control").write_text("+memory")
                (parent / "cgroup.subtree_control").write_text("+memory")
            path = parent / name
            path.mkdir(exist_ok=True)
            limit = str(limit_mib << 20)
            if version == "v2":
                (path / "memory.max").write_text(limit)
                (path / "memory.swap.max").exists() and (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(limit)
        except PermissionError as e:
            raise HostError(f"cannot create a cgroup under {parent}: {e}; run as root or "
                            "delegate a cgroup subtree to this user") from e
        return cls(path, version)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit_bytes(self) -> int:
        f = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        return int((self.path / f).read_text().strip())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise HostError(f"cannot remove cgroup {self.path}: {e}") from e
                time.sleep(0.01)
