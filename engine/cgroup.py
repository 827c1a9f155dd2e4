"""A cgroup per child for its QEMU: memory, CPU time and host pids (v2, else v1).

cgroup v2 (one unified hierarchy): one directory ``forkd/<id>`` with ``memory.max``,
``cpu.max`` (quota and period) and ``pids.max``, the controllers enabled in the parents'
``cgroup.subtree_control``. cgroup v1 (this host): one directory per controller,
``<mount>/forkd/<id>`` in the memory (``memory.limit_in_bytes``), cpu
(``cpu.cfs_quota_us``/``cpu.cfs_period_us``), cpuacct (usage accounting next to a CPU
limit) and pids (``pids.max``) hierarchies. Only the controllers a child's limits need are
used; a child without limits has no cgroup.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from forkd.engine.errors import HostError

CGROOT = Path("/sys/fs/cgroup")
PARENT = "forkd"
CPU_PERIOD_US = 100_000  # the CFS period a CPU limit is expressed in (100 ms)
REMOVE_TIMEOUT_S = 15.0  # a dead task's memory can keep a cgroup busy for a while (OOM kills)


@dataclass(frozen=True)
class CgroupLimits:
    """What a child's cgroup enforces; None = no limit of that kind."""

    memory_mib: int | None = None
    cpus: float | None = None  # CPU time in CPUs: 0.5 = half of one core, 2 = two cores
    pids: int | None = None  # host tasks (processes + threads) of the child's QEMU

    def controllers(self) -> list[str]:
        out = []
        if self.memory_mib is not None:
            out.append("memory")
        if self.cpus is not None:
            out += ["cpu", "cpuacct"]
        if self.pids is not None:
            out.append("pids")
        return out


def v2_controllers() -> set[str]:
    """Controllers of the unified (v2) hierarchy mounted at CGROOT (empty when v1)."""
    ctl = CGROOT / "cgroup.controllers"
    try:
        return set(ctl.read_text().split()) if ctl.exists() else set()
    except OSError:
        return set()


def v1_mount(controller: str) -> Path | None:
    """The v1 hierarchy of a controller (from /proc/self/mounts), or None when it is not
    mounted."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and controller in parts[3].split(","):
            return Path(parts[1])
    return None


def version() -> str | None:
    """"v2" when the unified hierarchy has the memory controller, "v1" when the v1 memory
    hierarchy is mounted, else None."""
    if "memory" in v2_controllers():
        return "v2"
    if v1_mount("memory") is not None:
        return "v1"
    return None


def detect() -> tuple[str, Path] | None:
    """("v2", root) or ("v1", memory mount), or None when no memory controller is usable."""
    v = version()
    if v == "v2":
        return "v2", CGROOT
    if v == "v1":
        mount = v1_mount("memory")
        assert mount is not None
        return "v1", mount
    return None


def _write(path: Path, value: str) -> None:
    path.write_text(value)


class ChildCgroup:
    """The cgroup directories of one child, per controller (v2: all the same directory).
    create() makes them with the limits, add() moves a pid in, remove() is idempotent."""

    def __init__(self, paths: dict[str, Path], version: str) -> None:
        self.paths = paths
        self.version = version

    @property
    def path(self) -> Path:
        """The main directory: the memory one when there is a memory limit."""
        return self.paths.get("memory") or next(iter(self.paths.values()))

    @classmethod
    def create(cls, name: str, limits: CgroupLimits) -> ChildCgroup:
        wanted = limits.controllers()
        if not wanted:
            raise HostError("no cgroup limit asked for")
        v2 = v2_controllers()
        if v2 and "memory" in v2:
            return cls._create_v2(name, limits, wanted, v2)
        return cls._create_v1(name, limits, wanted)

    @classmethod
    def _create_v2(cls, name: str, limits: CgroupLimits, wanted: list[str],
                   available: set[str]) -> ChildCgroup:
        need = sorted({c for c in wanted if c != "cpuacct"})  # v2's cpu does the accounting
        missing = [c for c in need if c not in available]
        if missing:
            raise HostError(f"the cgroup v2 hierarchy has no {', '.join(missing)} controller; "
                            "enable it or fork without that limit")
        parent = CGROOT / PARENT
        path = parent / name
        try:
            parent.mkdir(exist_ok=True)
            enable = " ".join(f"+{c}" for c in need)
            with contextlib.suppress(OSError):  # may already be on, or managed by systemd
                _write(CGROOT / "cgroup.subtree_control", enable)
            _write(parent / "cgroup.subtree_control", enable)
            path.mkdir(exist_ok=True)
            cg = cls({c: path for c in wanted}, "v2")
            cg._set_v2(limits)
        except PermissionError as e:
            raise HostError(f"cannot create a cgroup under {parent}: {e}; run as root or "
                            "delegate a cgroup subtree to this user") from e
        return cg

    def _set_v2(self, limits: CgroupLimits) -> None:
        path = self.path
        if limits.memory_mib is not None:
            _write(path / "memory.max", str(limits.memory_mib << 20))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
        if limits.cpus is not None:
            _write(path / "cpu.max", f"{cpu_quota_us(limits.cpus)} {CPU_PERIOD_US}")
        if limits.pids is not None:
            _write(path / "pids.max", str(limits.pids))

    @classmethod
    def _create_v1(cls, name: str, limits: CgroupLimits, wanted: list[str]) -> ChildCgroup:
        mounts: dict[str, Path] = {}
        for c in wanted:
            m = v1_mount(c)
            if m is None:
                raise HostError(f"no cgroup {c} controller is mounted (v1 or v2); mount one "
                                "or fork without that limit")
            mounts[c] = m
        cg = cls({}, "v1")
        try:
            for c, m in mounts.items():
                (m / PARENT).mkdir(exist_ok=True)
                path = m / PARENT / name
                path.mkdir(exist_ok=True)
                cg.paths[c] = path
            if limits.memory_mib is not None:
                _write(cg.paths["memory"] / "memory.limit_in_bytes", str(limits.memory_mib << 20))
            if limits.cpus is not None:
                _write(cg.paths["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cg.paths["cpu"] / "cpu.cfs_quota_us", str(cpu_quota_us(limits.cpus)))
            if limits.pids is not None:
                _write(cg.paths["pids"] / "pids.max", str(limits.pids))
        except PermissionError as e:
            cg.remove()
            raise HostError(f"cannot create a cgroup for {name}: {e}; run as root or "
                            "delegate a cgroup subtree to this user") from e
        except OSError:
            cg.remove()
            raise
        return cg

    @classmethod
    def from_record(cls, name: str, paths: dict[str, str], version: str) -> ChildCgroup:
        """The cgroup of a child's on-disk record; refuses paths that are not forkd's
        ``.../forkd/<name>`` under /sys/fs/cgroup (a record is never trusted to name others)."""
        out: dict[str, Path] = {}
        for c, p in paths.items():
            path = Path(p)
            if (not path.is_absolute() or ".." in path.parts or path.name != name
                    or path.parent.name != PARENT or CGROOT not in path.parents):
                raise HostError(f"child {name}: its record names cgroup {p!r}, which is not "
                                f"a forkd cgroup; remove it by hand if it is one")
            out[c] = path
        return cls(out, version if version in ("v1", "v2") else "v1")

    def record(self) -> dict[str, str]:
        return {c: str(p) for c, p in self.paths.items()}

    def add(self, pid: int) -> None:
        for p in dict.fromkeys(self.paths.values()):
            _write(p / "cgroup.procs", str(pid))

    def limit_bytes(self) -> int:
        f = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        return int((self.paths["memory"] / f).read_text().strip())

    def cpu_usage_ns(self) -> int:
        """CPU time used by the cgroup's tasks so far (v1 cpuacct.usage, v2 cpu.stat)."""
        if self.version == "v2":
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) * 1000
            raise HostError(f"{self.path}/cpu.stat has no usage_usec")
        return int((self.paths["cpuacct"] / "cpuacct.usage").read_text())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self, timeout: float | None = None) -> None:
        """rmdir every directory, retrying while the kernel still holds the dead tasks."""
        deadline = time.monotonic() + (REMOVE_TIMEOUT_S if timeout is None else timeout)
        for path in dict.fromkeys(self.paths.values()):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise HostError(f"cannot remove cgroup {path}: {e} (tasks still in it: "
                                    f"{(path / 'cgroup.procs').read_text().split() or 'none'})"
                                    ) from e
                    time.sleep(0.01)


def cpu_quota_us(cpus: float) -> int:
    return max(1000, round(cpus * CPU_PERIOD_US))  # the kernel's minimum quota is 1 ms
