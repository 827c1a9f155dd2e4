"""Fork children from a snapshot and reach them later from any shell.

Each child lives in its own directory under paths.children_dir()/<id>/ with a
child.json describing it; its QEMU runs detached in its own session, so the
command that forked it may exit. Requests to one child are serialised by an
flock on <dir>/lock (its QMP and agent sockets accept one client at a time).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forkd.engine import netns
from forkd.engine.accel import AccelVerdict, cached_probe
from forkd.engine.agent_client import PROTOCOL, AgentClient
from forkd.engine.cgroup import MemoryCgroup
from forkd.engine.errors import (
    ChildDead,
    ChildNotFound,
    EngineError,
    HostError,
    VMMError,
)
from forkd.engine.paths import children_dir
from forkd.engine.qemu import (
    CPU_MODEL,
    MACHINE,
    QemuVM,
    VMConfig,
    create_overlay,
    pid_alive,
    pid_matches,
    qemu_version,
    unprivileged_user,
)
from forkd.engine.qmp import QMP
from forkd.errors import InvalidInput
from forkd.pack.config import Compat
from forkd.store.store import Assembled, Store

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
MAX_CHILDREN = 512
Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class ChildInfo:
    id: str
    ref: str
    digest: str
    pid: int
    dir: str
    memory: str
    disk_backing: str
    memory_mib: int
    created: float
    cgroup: str | None = None
    cgroup_version: str | None = None
    netns: str | None = None
    mac: str | None = None
    ip: str | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    status: str = "running"

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def save(self) -> None:
        tmp = self.path / "child.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.path / "child.json")

    @classmethod
    def load(cls, d: Path) -> ChildInfo:
        try:
            raw = json.loads((d / "child.json").read_text())
        except FileNotFoundError as e:
            raise ChildNotFound(f"no child {d.name!r}; `forkd ls` lists the children") from e
        raw.pop("status", None)
        return cls(**raw)

    def state(self) -> str:
        """running, or crashed when its QEMU is gone without `forkd kill`."""
        if pid_alive(self.pid) and pid_matches(self.pid, self.path):
            return "running"
        return "crashed"


@dataclass(frozen=True)
class ForkResult:
    children: list[ChildInfo]
    assemble_ms: float
    total_ms: float
    errors: list[str]


# ---------------------------------------------------------------- compat
def check_compat(asm: Assembled, verdict: AccelVerdict) -> None:
    """Fail before any VM starts when this host cannot honour the snapshot."""
    c: Compat | None = asm.config.compat
    name = asm.config.tag
    if c is None:
        raise HostError(f"{name} records no compat metadata; it cannot be restored safely")
    problems = []
    if c.vmm != "qemu":
        problems.append(f"it needs VMM {c.vmm!r}, this engine runs qemu")
    if c.machine != MACHINE or c.cpu_model != CPU_MODEL:
        problems.append(f"it needs machine {c.machine}/cpu {c.cpu_model}, "
                        f"the engine runs {MACHINE}/{CPU_MODEL}")
    host_v = qemu_version().split(".")[:2]
    if c.vmm_version.split(".")[:2] != host_v:
        problems.append(f"it was made with QEMU {c.vmm_version}, this host has "
                        f"{qemu_version()} (device state is not portable across versions)")
    if verdict.accel not in c.accelerators:
        problems.append(f"it was made under {'/'.join(c.accelerators)}, this host uses "
                        f"{verdict.accel} ({verdict.reason})")
    if c.agent_protocol != PROTOCOL:
        problems.append(f"its guest agent speaks protocol {c.agent_protocol}, the host {PROTOCOL}")
    if asm.vmstate is None:
        problems.append("it has no device state (vmstate) file")
    if asm.disk is None:
        problems.append("it has no root disk image")
    if asm.memory.stat().st_size != c.memory_mib << 20:
        problems.append(f"its memory image is {asm.memory.stat().st_size} bytes, "
                        f"not {c.memory_mib} MiB")
    if problems:
        raise HostError(f"cannot restore {name} on this host: " + "; ".join(problems)
                        + ". Rebuild it here with `forkd build`.")


# ---------------------------------------------------------------- fork
def _new_id(ref: str) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", ref.split("/")[-1].split(":")[0].lower()).strip("-")
    return f"{base[:20] or 'vm'}-{secrets.token_hex(3)}"


def restore(qmp: QMP, vmstate: Path, timeout: float = 60.0) -> None:
    """Load device state (RAM is already mapped from the image) and run."""
    qmp.command("migrate-set-capabilities",
                {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
    # no announcements of the template's MAC from every clone
    qmp.command("migrate-set-parameters", {"announce-rounds": 0})
    fd = os.open(vmstate, os.O_RDONLY | os.O_CLOEXEC)
    try:
        qmp.command("getfd", {"fdname": "vmstate"}, fds=[fd])
    finally:
        os.close(fd)
    qmp.command("migrate-incoming", {"uri": "fd:vmstate"})
    st = qmp.wait_status({"paused", "running"}, timeout=timeout)
    if st == "paused":
        qmp.command("cont")


def fixup(agent: AgentClient, child_id: str, net: dict[str, str] | None = None,
          timeout: float = 30.0) -> dict[str, Any]:
    args: dict[str, Any] = {"time": time.time(), "seed": secrets.token_hex(32),
                            "hostname": child_id}
    if net:
        args["net"] = net
    return agent.request("fixup", args, timeout=timeout)


def has_nic(vmstate: Path) -> bool:
    """Whether the saved device state contains a virtio-net device (its section names do)."""
    return b"virtio-net" in vmstate.read_bytes()


def _spawn_one(asm: Assembled, ref: str, child_id: str, overlay_tpl: Path,
               memory_limit_mib: int | None, sandbox: bool, with_netns: bool) -> ChildInfo:
    assert asm.vmstate is not None and asm.disk is not None and asm.config.compat is not None
    c = asm.config.compat
    d = children_dir() / child_id
    d.mkdir(mode=0o700)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    disk = d / "disk.qcow2"
    shutil.copyfile(overlay_tpl, disk)
    cfg = VMConfig(memory_mib=c.memory_mib, vcpus=c.vcpus, accel=c.accelerators[0],
                   mem_path=asm.memory, share=False, disk=disk, disk_cache="writeback",
                   incoming=True, sandbox=sandbox, runas=unprivileged_user() if sandbox else None,
                   tap="tap0" if with_netns else None, mac=netns.TEMPLATE_MAC)
    info = ChildInfo(id=child_id, ref=ref, digest=asm.digest, pid=0, dir=str(d),
                     memory=str(asm.memory), disk_backing=str(asm.disk),
                     memory_mib=c.memory_mib, created=time.time())
    net: dict[str, str] | None = None
    ns_name = f"{netns.PREFIX}{child_id}" if with_netns else None
    vm = QemuVM(d, cfg, detach=True, netns=ns_name)
    cg: MemoryCgroup | None = None
    try:
        if ns_name is not None:
            info.netns = ns_name
            info.mac, info.ip = netns.child_identity(child_id)
            net = {"ifname": "eth0", "mac": info.mac, "address": info.ip,
                   "gateway": netns.GW_IP}
            info.save()
            netns.create(ns_name)
        if memory_limit_mib is not None:
            cg = MemoryCgroup.create(child_id, memory_limit_mib)
            info.cgroup, info.cgroup_version = str(cg.path), cg.version
        vm.launch()
        assert vm.pid is not None and vm.qmp is not None
        info.pid = vm.pid
        info.save()  # from here on `forkd kill` can find it
        if cg is not None:
            cg.add(vm.pid)
        timings["qmp_up"] = (time.monotonic() - t0) * 1000
        agent = AgentClient(d / "agent.sock", alive=vm.alive)  # connect before the restore
        try:
            restore(vm.qmp, asm.vmstate)
            timings["running"] = (time.monotonic() - t0) * 1000
            fixup(agent, child_id, net)
            timings["fixed_up"] = (time.monotonic() - t0) * 1000
            agent.ping()
            timings["ready"] = (time.monotonic() - t0) * 1000
        finally:
            agent.close()
        info.timings_ms = {k: round(v, 1) for k, v in timings.items()}
        info.save()
        vm.qmp.close()
        return info
    except BaseException as e:
        tail = vm.log_tail()
        vm.kill()
        if cg is not None:
            with contextlib.suppress(EngineError):
                cg.remove()
        if ns_name is not None:
            with contextlib.suppress(EngineError):
                netns.remove(ns_name)
        shutil.rmtree(d, ignore_errors=True)
        if isinstance(e, EngineError):
            raise type(e)(f"child {child_id}: {e}\n{tail}") from e
        raise


def fork(store: Store, ref: str, n: int, *, memory_limit_mib: int | None = None,
         sandbox: bool = True, with_netns: bool = False, progress: Progress = _noop,
         parallel: int | None = None) -> ForkResult:
    if not isinstance(n, int) or n <= 0 or n > MAX_CHILDREN:
        raise InvalidInput(f"number of children must be between 1 and {MAX_CHILDREN}, got {n}")
    if memory_limit_mib is not None and memory_limit_mib < 64:
        raise InvalidInput(f"--memory-limit-mib {memory_limit_mib} is too small (>= 64)")
    t0 = time.monotonic()
    asm = store.assemble(ref)  # verifies chunks while writing the image: corrupt → no VM
    asm_ms = (time.monotonic() - t0) * 1000
    check_compat(asm, cached_probe())
    assert asm.disk is not None and asm.config.compat is not None and asm.vmstate is not None
    nic = has_nic(asm.vmstate)
    if with_netns and not nic:
        raise InvalidInput(f"{ref} has no network device, so --netns cannot give its children "
                           "a network; build the recipe with `network = true` under [guest]")
    if nic:
        # the saved virtio-net state needs a tap backend (vnet_hdr): every child gets its own
        why = netns.available()
        if why:
            raise HostError(f"{ref} has a network device, so its children need a network "
                            f"namespace + tap, but {why}")
        if not with_netns:
            progress(f"{ref} has a network device: each child gets its own namespace")
            with_netns = True
    if memory_limit_mib is not None and memory_limit_mib < asm.config.compat.memory_mib:
        progress(f"note: memory limit {memory_limit_mib} MiB is below the guest's "
                 f"{asm.config.compat.memory_mib} MiB")
    ids = [_new_id(ref) for _ in range(n)]
    tpl_dir = children_dir() / f".overlay-{secrets.token_hex(4)}"
    tpl_dir.mkdir()
    overlay = tpl_dir / "empty.qcow2"
    results: list[ChildInfo | None] = [None] * n
    errors: list[str] = []
    try:
        create_overlay(overlay, asm.disk, "raw")
        sem = threading.Semaphore(parallel or min(n, 64))

        def run(i: int) -> None:
            with sem:
                try:
                    info = _spawn_one(asm, ref, ids[i], overlay, memory_limit_mib, sandbox,
                                      with_netns)
                    results[i] = info
                    progress(f"{info.id} ready in {info.timings_ms['ready']:.0f} ms")
                except Exception as e:
                    errors.append(f"{ids[i]}: {e}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        shutil.rmtree(tpl_dir, ignore_errors=True)
    ok = [r for r in results if r is not None]
    if errors and not ok:
        raise VMMError("no child started:\n" + "\n".join(errors[:5]))
    return ForkResult(ok, asm_ms, (time.monotonic() - t0) * 1000, errors)


# ---------------------------------------------------------------- reach children
def _child_dir(child_id: str) -> Path:
    if not isinstance(child_id, str) or not _ID_RE.match(child_id):
        raise InvalidInput(f"invalid child id {child_id!r}; `forkd ls` lists the children")
    d = children_dir() / child_id
    if not (d / "child.json").exists():
        raise ChildNotFound(f"no child {child_id!r}; `forkd ls` lists the children")
    return d


def get(child_id: str) -> ChildInfo:
    return ChildInfo.load(_child_dir(child_id))


def list_children() -> list[ChildInfo]:
    out = []
    for d in sorted(children_dir().iterdir()):
        if d.name.startswith(".") or not (d / "child.json").exists():
            continue
        with contextlib.suppress(ChildNotFound, ValueError, TypeError):
            info = ChildInfo.load(d)
            info.status = info.state()
            out.append(info)
    return out


@contextlib.contextmanager
def locked(info: ChildInfo, timeout: float = 60.0) -> Iterator[None]:
    fd = os.open(info.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineError(f"child {info.id} is busy with another request "
                                      f"for more than {timeout:.0f} s") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)


def _require_running(info: ChildInfo) -> None:
    if info.state() != "running":
        raise ChildDead(f"child {info.id} is not running (its QEMU process {info.pid} is gone: "
                        f"crashed or killed); `forkd kill {info.id}` cleans it up")


@contextlib.contextmanager
def agent(child_id: str, timeout: float = 10.0) -> Iterator[AgentClient]:
    info = get(child_id)
    _require_running(info)
    with locked(info):
        try:
            client = AgentClient(info.path / "agent.sock", timeout=timeout,
                                 alive=lambda: pid_alive(info.pid))
        except VMMError as e:
            raise ChildDead(f"child {child_id}: cannot reach its agent: {e}") from e
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def qmp(info: ChildInfo) -> Iterator[QMP]:
    q = QMP(info.path / "qmp.sock", timeout=10.0, alive=lambda: pid_alive(info.pid))
    try:
        yield q
    finally:
        q.close()


def exec_in(child_id: str, argv: list[str], *, timeout: float | None = None,
            stdin: bytes | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None) -> dict[str, Any]:
    if not argv:
        raise InvalidInput("nothing to execute: give a command after --")
    with agent(child_id) as a:
        return a.exec(argv, timeout=timeout, stdin=stdin, env=env, cwd=cwd)


def eval_in(child_id: str, code: str, timeout: float = 300.0) -> dict[str, Any]:
    with agent(child_id) as a:
        return a.eval(code, timeout=timeout)


def kill(child_id: str) -> ChildInfo:
    """Stop the child's QEMU and remove everything it had. Safe on crashed children."""
    info = get(child_id)
    was = info.state()
    if was == "running":
        vm = QemuVM(info.path, VMConfig(memory_mib=info.memory_mib, vcpus=1, accel="tcg",
                                        mem_path=Path(info.memory), share=False,
                                        disk=info.path / "disk.qcow2"))
        vm.pid = info.pid
        with contextlib.suppress(VMMError):
            vm.qmp = QMP(info.path / "qmp.sock", timeout=2.0, alive=vm.alive)
        vm.shutdown(timeout=3.0)
    if info.cgroup:
        MemoryCgroup(Path(info.cgroup), info.cgroup_version or "v1").remove()
    if info.netns:
        netns.remove(info.netns)
    shutil.rmtree(info.path, ignore_errors=True)
    info.status = "killed" if was == "running" else "crashed"
    return info


def kill_all() -> list[ChildInfo]:
    return [kill(c.id) for c in list_children()]
