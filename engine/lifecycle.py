"""One child's life, from launch to cleanup: the one owner of everything a child has.

A child (or a pool's waiting process) is a QEMU process in its own directory
``$FORKD_RUN/children/<id>/`` (sockets, logs, overlay disk, lock), maybe a network namespace
``forkd-<id>`` with its tap, maybe cgroups ``forkd/<id>``, and its on-disk record
(``child.json``, or ``waiting.json`` for a pool's process). ``ChildVM`` makes them
(``launch``), finds them again from the record in any process (``adopt``), ends the process
(``stop``: QMP quit, then SIGKILL; ``kill``: SIGKILL) and removes everything (``cleanup``,
idempotent, safe on a half-made or crashed child). children.py, pool.py, the lifetimes
sweeper and the controller end children only through it. A child with egress also has its
proxy process (``start_proxy``; ended by ``stop``'s callers through ``cleanup``/``release``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forkd.engine import disk_budget, netns
from forkd.engine.cgroup import CgroupLimits, ChildCgroup
from forkd.engine.commands import MAX_WAIT_S
from forkd.engine.egress import child as egress
from forkd.engine.errors import Busy, ChildDead, ChildNotFound, EngineError, HostError, VMMError
from forkd.engine.lazy.paths import server_dir_of
from forkd.engine.paths import children_dir
from forkd.engine.qemu import QemuVM, VMConfig, pid_alive, pid_matches, unprivileged_user
from forkd.errors import InvalidInput
from forkd.jsondoc import is_integer
from forkd.names import parse_ref, shown
from forkd.store.store import Assembled

ID_RE = re.compile(r"\A[a-z0-9][a-z0-9-]{0,63}\Z")
CHILD_FILE = "child.json"
WAITING_FILE = "waiting.json"  # a pool's waiting process (not a child yet: `forkd ls` skips it)

# Bounds of the per-child limits (docs/engine.md, "Limits").
MIN_MEMORY_MIB = 64
MAX_CPUS = 256.0
MIN_CPUS = 0.01
MIN_PIDS, MAX_PIDS = 32, 4_194_304  # QEMU itself needs a handful of threads
MIN_DISK_BPS, MAX_DISK_BPS = 64 << 10, 1 << 40  # 64 KiB/s .. 1 TiB/s
MIN_DISK_IOPS, MAX_DISK_IOPS = 10, 10_000_000


@dataclass(frozen=True)
class Limits:
    """Per-child resource limits; None = unlimited. Memory, CPU time and host pids are
    cgroup limits on the child's QEMU, disk I/O is QEMU's throttling of its drive, the
    network rate is tc on its tap."""

    memory_mib: int | None = None
    cpus: float | None = None  # CPU time in CPUs: 0.5 = half of one core
    pids: int | None = None  # host tasks (processes + threads) of its QEMU
    disk_bps: int | None = None  # disk bytes/s, read + write
    disk_iops: int | None = None  # disk operations/s, read + write
    net_kbit: int | None = None  # network kbit/s to the guest (tbf on its tap; needs a netns)

    def checked(self) -> Limits:
        """Itself, or InvalidInput naming the limit that is out of range."""
        _check_int("memory limit (MiB)", self.memory_mib, MIN_MEMORY_MIB, 1 << 30)
        if self.cpus is not None and (
                isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float))
                or not math.isfinite(self.cpus) or not MIN_CPUS <= self.cpus <= MAX_CPUS):
            raise InvalidInput(f"cpus must be a number from {MIN_CPUS} to {MAX_CPUS:.0f} "
                                   f"(0.5 = half of one core), got {self.cpus!r}")
        _check_int("pids limit", self.pids, MIN_PIDS, MAX_PIDS)
        _check_int("disk bytes/s", self.disk_bps, MIN_DISK_BPS, MAX_DISK_BPS)
        _check_int("disk operations/s", self.disk_iops, MIN_DISK_IOPS, MAX_DISK_IOPS)
        _check_int("network kbit/s", self.net_kbit, netns.MIN_RATE_KBIT, netns.MAX_RATE_KBIT)
        return self

    def cgroup(self) -> CgroupLimits:
        return CgroupLimits(self.memory_mib, self.cpus, self.pids)

    def shown(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _check_int(what: str, value: object, lo: int, hi: int) -> None:
    if value is None:
        return
    if not is_integer(value, lo, hi):
        raise InvalidInput(f"{what} must be an integer from {lo} to {hi}, got {value!r}")


@dataclass
class ChildInfo:
    """A child's on-disk record (child.json): what any process needs to reach or end it."""

    id: str
    ref: str
    digest: str
    pid: int
    dir: str
    memory: str
    disk_backing: str
    memory_mib: int
    created: float
    cgroup: str | None = None  # the main cgroup directory (the memory one when limited)
    cgroup_version: str | None = None
    cgroups: dict[str, str] = field(default_factory=dict)  # controller -> directory
    netns: str | None = None
    mac: str | None = None
    ip: str | None = None
    limits: dict[str, Any] = field(default_factory=dict)  # Limits.shown()
    sandbox: bool = True  # QEMU ran with -sandbox on (a resume starts it the same way)
    deadline: float | None = None  # epoch seconds; the sweeper acts then (lifetimes.py)
    timeout_s: float | None = None  # the lifetime asked for (a resume gives it again)
    on_timeout: str = "kill"  # "kill" or "pause"
    paused_tag: str | None = None  # set while paused: the private tag of its saved state
    origin: str | None = None  # the tag it was first forked from (ref moves on pause)
    egress: dict[str, Any] = field(default_factory=dict)  # EgressSettings.record(); {}: none
    proxy_pid: int | None = None  # its egress proxy process (egress/serve.py) while it runs
    timings_ms: dict[str, float] = field(default_factory=dict)
    status: str = "running"

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def save(self, name: str = CHILD_FILE, **extra: Any) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps({**extra, **asdict(self)}, indent=1))
        tmp.replace(self.path / name)

    @classmethod
    def load(cls, d: Path, name: str = CHILD_FILE) -> ChildInfo:
        try:
            raw = json.loads((d / name).read_text())
        except FileNotFoundError as e:
            raise ChildNotFound(f"no child {d.name!r}; `forkd ls` lists the children") from e
        except (OSError, ValueError) as e:
            raise _bad_record(d / name, str(e)) from e
        if not isinstance(raw, dict):
            raise _bad_record(d / name, "not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)} - {"status"}
        try:
            info = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as e:
            raise _bad_record(d / name, str(e)) from e
        if (not isinstance(info.id, str) or not isinstance(info.dir, str)
                or not isinstance(info.pid, int) or info.id != d.name
                or info.path.resolve() != d.resolve()):
            raise _bad_record(d / name, f"it describes {info.id!r} in {info.dir!r}")
        return info

    def limits_obj(self) -> Limits:
        known = {f.name for f in dataclasses.fields(Limits)}
        return Limits(**{k: v for k, v in self.limits.items() if k in known})

    def state(self) -> str:
        """running, paused (state saved, no process), or crashed when its QEMU is gone
        without `forkd kill`."""
        if self.paused_tag is not None and not (self.pid and pid_alive(self.pid)
                                                 and pid_matches(self.pid, self.path)):
            return "paused"
        if self.pid and pid_alive(self.pid) and pid_matches(self.pid, self.path):
            return "running"
        return "crashed"


def _bad_record(path: Path, why: str) -> HostError:
    return HostError(f"{path} is not a valid child record ({why}); stop its QEMU if one runs "
                     f"and remove {path.parent} by hand")


ID_RANDOM_BYTES = 8  # 64 random bits in an id (16 hex)


def new_id(ref: str) -> str:
    """A fresh child id from the snapshot's name: ``<name>-<16 hex>``. With 24 random bits
    an id came round among a long-running host's ids (one in 16 M per fork, per id
    remembered), and whatever still held the old one (a client's scope, a script, a
    log someone acts on) reached another client's new sandbox by it. Its length no
    longer reaches a socket's path (paths.unix_address, qemu.socket_arg)."""
    base = re.sub(r"[^a-z0-9]+", "-", ref.split("/")[-1].split(":")[0].lower()).strip("-")
    return f"{base[:20] or 'vm'}-{secrets.token_hex(ID_RANDOM_BYTES)}"


def child_dir(child_id: str) -> Path:
    """The directory of an existing child (InvalidInput for a malformed id, ChildNotFound)."""
    if not isinstance(child_id, str) or not ID_RE.fullmatch(child_id):
        raise InvalidInput(f"invalid child id {shown(child_id)}: ids are 1-64 of a-z, 0-9 and "
                           "'-'; `forkd ls` lists the children")
    d = children_dir() / child_id
    if not (d / CHILD_FILE).exists():
        raise ChildNotFound(f"no child {child_id!r}; `forkd ls` lists the children")
    return d


PAUSED_NAME = "forkd-paused"  # private tags of paused children: forkd-paused/<id>:a|b


def private_tags(child_id: str) -> tuple[str, str]:
    """The two tags a child's pauses alternate between (a diff layer cannot be its own
    parent, and a tag another layer descends from can still move)."""
    return f"{PAUSED_NAME}/{child_id}:a", f"{PAUSED_NAME}/{child_id}:b"


def private_owner(ref: str) -> str | None:
    """The id of the child whose private tag ``ref`` is (any tag under PAUSED_NAME/ is
    one), None for any other tag or text that is not a reference."""
    try:
        name = parse_ref(ref).name
    except InvalidInput:
        return None
    top, sep, child_id = name.partition("/")
    return child_id if top == PAUSED_NAME and sep else None


@contextlib.contextmanager
def lock_file(path: Path, timeout: float, busy: str, poll: float = 0.01, *,
              shared: bool = False) -> Iterator[None]:
    """Hold an exclusive (or, shared=True, a shared) flock on ``path`` (made 0600), waiting
    up to ``timeout`` seconds; Busy (a Conflict) ``busy`` when it stays taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Busy(f"{busy} for more than {timeout:.0f} s; try again once it "
                               "ended") from None
                time.sleep(poll)
        yield
    finally:
        os.close(fd)


def record_lock(d: Path, timeout: float = 120.0) -> contextlib.AbstractContextManager[None]:
    """Serialise read-modify-write of a child's record (extend, pause, resume, the sweeper);
    apart from the request lock, so an extend never waits for a long exec."""
    busy = f"child {d.name}: its record is busy (a pause or resume is running)"
    return lock_file(d / "record.lock", timeout, busy)


def require_running(info: ChildInfo) -> None:
    state = info.state()
    if state == "paused":
        raise ChildDead(f"child {info.id} is paused; `forkd resume {info.id}` brings it back")
    if state != "running":
        raise ChildDead(f"child {info.id} is not running (its QEMU process {info.pid} is gone: "
                        f"crashed or killed); `forkd kill {info.id}` cleans it up")


def step_failed(child_id: str, e: BaseException, tail: str) -> EngineError | None:
    """What a failed step of starting a child raises, ending with ``tail`` (QEMU's log
    and how QEMU ended, once: QemuVM.launch's own error already carries it): an engine
    error naming the child, or a VMMError for an OSError (a socket QEMU reset as it died,
    a disk copy that failed); None: ``e`` as it is."""
    shown = "" if tail in str(e) else f"\n{tail}"
    if isinstance(e, EngineError):
        return type(e)(f"child {child_id}: {e}{shown}")
    if isinstance(e, OSError):
        return VMMError(f"child {child_id}: {e}{shown}")
    return None


@dataclass
class ChildVM:
    """One child's QEMU process and everything made for it. ``vm`` is the process (launched
    here, or attached to from the record); ``cgroup`` and ``info.netns`` what it runs in."""

    info: ChildInfo
    vm: QemuVM | None
    cgroup: ChildCgroup | None = None
    record_name: str = CHILD_FILE
    owner: int | None = None  # for a pool's waiting process: the pid that owns it
    cleaned: bool = False

    @property
    def id(self) -> str:
        return self.info.id

    # ------------------------------------------------------------ making one
    @classmethod
    def launch(cls, asm: Assembled, ref: str, child_id: str, overlay_tpl: Path,
               limits: Limits, sandbox: bool, with_netns: bool, *,
               pooled: bool = False, resuming: bool = False) -> ChildVM:
        """Directory, overlay disk (a copy of overlay_tpl), netns + tap (rate-limited), cgroup,
        and QEMU started with `-incoming defer`, QMP connected. Recorded as soon as there is
        something to clean up: in waiting.json (owner = this process) when pooled, else
        child.json. On failure everything made is removed and the error carries the log.
        resuming: the directory is a paused child's (pause.resume puts its record back
        when the launch fails)."""
        assert asm.vmstate is not None and asm.disk is not None and asm.config.compat is not None
        if not ID_RE.fullmatch(child_id):
            raise InvalidInput(f"invalid child id {child_id!r}")
        c = asm.config.compat
        d = children_dir() / child_id
        d.mkdir(mode=0o700, exist_ok=resuming)  # a resume starts again in its paused dir
        disk = d / "disk.qcow2"
        # a lazy server's memory file is produced on first access: QEMU's huge-page advice
        # would have each first touch read 4 MiB of it (hugepages.py)
        cfg = VMConfig(memory_mib=c.memory_mib, vcpus=c.vcpus, accel=c.accelerators[0],
                       mem_path=asm.memory, share=False, disk=disk, disk_cache="writeback",
                       incoming=True, sandbox=sandbox,
                       runas=unprivileged_user() if sandbox else None,
                       tap="tap0" if with_netns else None, mac=netns.TEMPLATE_MAC,
                       disk_bps=limits.disk_bps, disk_iops=limits.disk_iops,
                       huge_page_advice=server_dir_of(asm.memory) is None)
        info = ChildInfo(id=child_id, ref=ref, digest=asm.digest, pid=0, dir=str(d),
                         memory=str(asm.memory), disk_backing=str(asm.disk),
                         memory_mib=c.memory_mib, created=time.time(), limits=limits.shown(),
                         sandbox=sandbox, origin=ref)
        ns_name = f"{netns.PREFIX}{child_id}" if with_netns else None
        vm = QemuVM(d, cfg, detach=True, netns=ns_name)
        child = cls(info, vm, record_name=WAITING_FILE if pooled else CHILD_FILE,
                    owner=os.getpid() if pooled else None)
        try:
            disk_budget.place_overlay(overlay_tpl, disk)  # FORKD_DISK_BUDGET, if set
            if ns_name is not None:
                info.netns = ns_name
                info.mac, info.ip = netns.child_identity(child_id)
                child.record()
                netns.create(ns_name)
                if limits.net_kbit is not None:
                    netns.limit_rate(ns_name, limits.net_kbit)
            if limits.cgroup().controllers():
                child.cgroup = ChildCgroup.create(child_id, limits.cgroup())
                info.cgroup, info.cgroup_version = str(child.cgroup.path), child.cgroup.version
                info.cgroups = child.cgroup.record()
                child.record()
            vm.launch()
            assert vm.pid is not None
            info.pid = vm.pid
            child.record()  # from here on `forkd kill` (or the pool's sweep) can find it
            if child.cgroup is not None:
                child.cgroup.add(vm.pid)
            return child
        except BaseException as e:
            tail = vm.log_tail()
            with contextlib.suppress(EngineError):  # the launch's own error is the one to see
                child.cleanup()
            failed = step_failed(child_id, e, tail)
            if failed is None:
                raise
            raise failed from e

    def record(self) -> None:
        """Write the record (child.json, or waiting.json with the owner pid)."""
        if self.record_name == WAITING_FILE:
            self.info.save(WAITING_FILE, owner=self.owner)
        else:
            self.info.save()

    def become_child(self) -> None:
        """A pool's waiting process is now a child: child.json replaces waiting.json."""
        self.record_name = CHILD_FILE
        self.owner = None
        self.info.save()
        (self.info.path / WAITING_FILE).unlink(missing_ok=True)

    def start_proxy(self, settings: egress.EgressSettings) -> None:
        """Start the child's egress proxy on the host side of its network namespace
        (recorded at once, so every cleanup path ends it); ``wait_proxy`` waits for it."""
        if self.info.netns is None:
            raise InvalidInput(f"child {self.id}: egress needs a network namespace")
        self.info.egress = settings.record()
        self.info.proxy_pid = egress.start_proxy(settings, self.id, self.info.netns,
                                                 self.info.path)
        self.record()

    def wait_proxy(self) -> None:
        assert self.info.proxy_pid is not None
        egress.wait_ready(self.info.proxy_pid, self.info.path)

    def stop_proxy(self) -> None:
        """End the egress proxy (before the netns goes: its listening socket holds the
        namespace). Nothing when there is none."""
        if self.info.proxy_pid is not None:
            egress.stop_proxy(self.info.proxy_pid, self.info.path)
            self.info.proxy_pid = None

    # ------------------------------------------------------------ finding one
    @classmethod
    def adopt(cls, d: Path, record_name: str = CHILD_FILE) -> ChildVM:
        """The child (or waiting process) of directory d, from its record, in any process.
        Its netns and cgroups are checked to be forkd's own for this id."""
        info = ChildInfo.load(d, record_name)
        owner: int | None = None
        if record_name == WAITING_FILE:
            raw = json.loads((d / WAITING_FILE).read_text())
            owner = int(raw["owner"])
        if info.netns is not None and info.netns != f"{netns.PREFIX}{info.id}":
            raise HostError(f"child {info.id}: its record names network namespace "
                            f"{info.netns!r}, not {netns.PREFIX}{info.id}")
        cgroup = None
        paths = info.cgroups or ({"memory": info.cgroup} if info.cgroup else {})
        if paths:
            cgroup = ChildCgroup.from_record(info.id, paths, info.cgroup_version or "v1")
        vm = QemuVM.attach(d, info.pid) if info.pid else None
        return cls(info, vm, cgroup, record_name=record_name, owner=owner)

    # ------------------------------------------------------------ ending one
    def alive(self) -> bool:
        return not self.cleaned and self.vm is not None and self.vm.alive()

    def stop(self, timeout: float = 3.0) -> None:
        """QMP quit → wait ≤ timeout → SIGKILL → wait. Nothing when it is not running."""
        if self.vm is not None:
            self.vm.shutdown(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL → wait (for a process nobody needs to hear from)."""
        if self.vm is not None:
            self.vm.kill()

    def cleanup(self) -> None:
        """Kill the process if it still runs, end its egress proxy, then remove its cgroups,
        netns (with the tap)
        and directory (sockets, disk, logs, record). Idempotent; every step is tried even
        when an earlier one fails. When a cgroup or the netns cannot be removed, the
        directory and its record stay (so `forkd kill ID` can be run again) and the first
        failure is raised."""
        if self.cleaned:
            return
        errors: list[EngineError] = []
        self.kill()
        self.stop_proxy()
        if self.cgroup is not None:
            try:
                self.cgroup.remove()
            except EngineError as e:
                errors.append(e)
        if self.info.netns is not None:
            try:
                netns.remove(self.info.netns)
            except EngineError as e:
                errors.append(e)
        if errors:
            raise type(errors[0])(f"child {self.id}: {errors[0]}; its QEMU is gone and its "
                                  f"record kept: run `forkd kill {self.id}` again once that "
                                  "is fixed")
        self.cleaned = True
        shutil.rmtree(self.info.path, ignore_errors=True)

    def release(self, timeout: float = 3.0) -> None:
        """What a pause frees: the process (stop), its cgroups, netns and the files in its
        directory (sockets, disk, logs) — all but the record and the locks."""
        with contextlib.suppress(EngineError):
            self.stop(timeout)
        self.kill()
        self.stop_proxy()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.info.netns is not None:
            netns.remove(self.info.netns)
        keep = {CHILD_FILE, "lock", "record.lock"}
        for f in self.info.path.iterdir():
            if f.name not in keep:
                if f.is_dir() and not f.is_symlink():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink(missing_ok=True)

    def end(self, timeout: float = 3.0) -> str:
        """stop() + cleanup(): what `forkd kill` does. Returns the state it was in."""
        was = self.info.state()
        with contextlib.suppress(EngineError):
            self.stop(timeout)
        self.cleanup()
        return was


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, MAX_WAIT_S  # a lifetime: 1 s .. 30 days
ON_TIMEOUT = ("kill", "pause")


@dataclass(frozen=True)
class Lifetime:
    """How long a child may run: after timeout_s (from when it is ready) the sweeper kills
    or pauses it (on_timeout). timeout_s None: no deadline."""

    timeout_s: float | None = None
    on_timeout: str = "kill"

    def checked(self) -> Lifetime:
        check_seconds("timeout", self.timeout_s)
        if self.on_timeout not in ON_TIMEOUT:
            raise InvalidInput(f"on_timeout must be one of {', '.join(ON_TIMEOUT)}, "
                               f"got {self.on_timeout!r}")
        return self

    def apply(self, info: ChildInfo, now: float | None = None) -> None:
        info.timeout_s = self.timeout_s
        info.on_timeout = self.on_timeout
        info.deadline = None if self.timeout_s is None else (now or time.time()) + self.timeout_s


def check_seconds(what: str, value: object) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        raise InvalidInput(f"{what} must be {MIN_TIMEOUT_S:.0f} s to {MAX_TIMEOUT_S:.0f} s "
                           f"(30 days), got {value!r}")
