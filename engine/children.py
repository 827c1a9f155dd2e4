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
from typing import Any, Protocol

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
def host_problems(c: Compat | None, verdict: AccelVerdict) -> list[str]:
    """Why this host cannot restore a snapshot with compat metadata ``c`` (empty: it can)."""
    if c is None:
        return ["it records no compat metadata, so it cannot be restored safely"]
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
    return problems


def check_compat(asm: Assembled, verdict: AccelVerdict) -> None:
    """Fail before any VM starts when this host cannot honour the snapshot."""
    c: Compat | None = asm.config.compat
    name = asm.config.tag
    if c is None:
        raise HostError(f"{name} records no compat metadata; it cannot be restored safely")
    problems = host_problems(c, verdict)
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


def prepare_incoming(qmp: QMP, vmstate: Path) -> None:
    """Everything before the restore that does not need the state loaded: capabilities,
    parameters, and the device-state file passed as an fd (a waiting process does this early)."""
    qmp.command("migrate-set-capabilities",
                {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
    # no announcements of the template's MAC from every clone
    qmp.command("migrate-set-parameters", {"announce-rounds": 0})
    fd = os.open(vmstate, os.O_RDONLY | os.O_CLOEXEC)
    try:
        qmp.command("getfd", {"fdname": "vmstate"}, fds=[fd])
    finally:
        os.close(fd)


def start_incoming(qmp: QMP, timeout: float = 60.0) -> None:
    """Load the device state passed by prepare_incoming and run."""
    qmp.command("migrate-incoming", {"uri": "fd:vmstate"})
    st = qmp.wait_status({"paused", "running"}, timeout=timeout)
    if st == "paused":
        qmp.command("cont")


def restore(qmp: QMP, vmstate: Path, timeout: float = 60.0) -> None:
    """Load device state (RAM is already mapped from the image) and run."""
    prepare_incoming(qmp, vmstate)
    start_incoming(qmp, timeout)


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


WAITING_FILE = "waiting.json"  # a pool's waiting process (not a child yet: `forkd ls` skips it)


@dataclass
class Waiting:
    """A QEMU process started with `-incoming defer` on one snapshot, its overlay disk, cgroup
    and netns in place, QMP and the agent socket connected and the device state passed:
    `become_child` restores, fixes up and pings it. `discard` removes it (idempotent)."""

    info: ChildInfo
    vm: QemuVM
    agent: AgentClient | None
    cgroup: MemoryCgroup | None
    net: dict[str, str] | None
    memory_limit_mib: int | None
    sandbox: bool
    with_netns: bool
    launch_ms: float
    pooled: bool = False
    stage: str = "incoming"  # "incoming": waits for the device state; "paused": restored ahead
    discarded: bool = False

    @property
    def id(self) -> str:
        return self.info.id

    def alive(self) -> bool:
        return not self.discarded and self.vm.alive()

    def discard(self) -> None:
        if self.discarded:
            return
        self.discarded = True
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.vm.kill()
        if self.cgroup is not None:
            with contextlib.suppress(EngineError):
                self.cgroup.remove()
        if self.info.netns is not None:
            with contextlib.suppress(EngineError):
                netns.remove(self.info.netns)
        shutil.rmtree(self.info.path, ignore_errors=True)


def launch_waiting(asm: Assembled, ref: str, child_id: str, overlay_tpl: Path,
                   memory_limit_mib: int | None, sandbox: bool, with_netns: bool, *,
                   pooled: bool = False) -> Waiting:
    """Start one QEMU waiting for the snapshot's device state (the process-start half of a
    spawn). pooled: record it in waiting.json (owner = this process) instead of child.json,
    so it is not a child until `become_child`."""
    assert asm.vmstate is not None and asm.disk is not None and asm.config.compat is not None
    c = asm.config.compat
    d = children_dir() / child_id
    d.mkdir(mode=0o700)
    t0 = time.monotonic()
    disk = d / "disk.qcow2"
    shutil.copyfile(overlay_tpl, disk)
    cfg = VMConfig(memory_mib=c.memory_mib, vcpus=c.vcpus, accel=c.accelerators[0],
                   mem_path=asm.memory, share=False, disk=disk, disk_cache="writeback",
                   incoming=True, sandbox=sandbox, runas=unprivileged_user() if sandbox else None,
                   tap="tap0" if with_netns else None, mac=netns.TEMPLATE_MAC)
    info = ChildInfo(id=child_id, ref=ref, digest=asm.digest, pid=0, dir=str(d),
                     memory=str(asm.memory), disk_backing=str(asm.disk),
                     memory_mib=c.memory_mib, created=time.time())
    ns_name = f"{netns.PREFIX}{child_id}" if with_netns else None
    vm = QemuVM(d, cfg, detach=True, netns=ns_name)
    w = Waiting(info=info, vm=vm, agent=None, cgroup=None, net=None,
                memory_limit_mib=memory_limit_mib, sandbox=sandbox, with_netns=with_netns,
                launch_ms=0.0, pooled=pooled)

    def record() -> None:
        if pooled:
            tmp = d / (WAITING_FILE + ".tmp")
            tmp.write_text(json.dumps({"owner": os.getpid(), **asdict(info)}, indent=1))
            tmp.replace(d / WAITING_FILE)
        else:
            info.save()

    try:
        if ns_name is not None:
            info.netns = ns_name
            info.mac, info.ip = netns.child_identity(child_id)
            w.net = {"ifname": "eth0", "mac": info.mac, "address": info.ip,
                     "gateway": netns.GW_IP}
            record()
            netns.create(ns_name)
        if memory_limit_mib is not None:
            w.cgroup = MemoryCgroup.create(child_id, memory_limit_mib)
            info.cgroup, info.cgroup_version = str(w.cgroup.path), w.cgroup.version
        vm.launch()
        assert vm.pid is not None and vm.qmp is not None
        info.pid = vm.pid
        record()  # from here on `forkd kill` (or the pool's sweep) can find it
        if w.cgroup is not None:
            w.cgroup.add(vm.pid)
        w.agent = AgentClient(d / "agent.sock", alive=vm.alive)  # connect before the restore
        assert asm.vmstate is not None
        prepare_incoming(vm.qmp, asm.vmstate)
        w.launch_ms = (time.monotonic() - t0) * 1000
        return w
    except BaseException as e:
        tail = vm.log_tail()
        w.discard()
        if isinstance(e, EngineError):
            raise type(e)(f"child {child_id}: {e}\n{tail}") from e
        raise


def restore_ahead(w: Waiting, timeout: float = 60.0) -> None:
    """Restore a waiting process before it is needed, run one throwaway fixup in it (QEMU
    translates the code of the restore and fixup paths now, not on the spawn's critical
    path: ~3x less guest CPU per spawn under TCG) and pause it. Nothing sees the guest
    before `become_child`'s fixup, which adds fresh host entropy, reseeds the CRNG and the
    PRNGs and sets the clock and hostname again, so children stay unique (the throwaway
    fixup only mixes in more entropy). On failure it is discarded."""
    if w.discarded or w.stage != "incoming":
        raise VMMError(f"child {w.id}: not waiting for its device state")
    try:
        assert w.vm.qmp is not None and w.agent is not None
        start_incoming(w.vm.qmp, timeout)
        fixup(w.agent, w.id, timeout=timeout)  # no network identity yet: only at the take
        w.agent.ping(timeout)
        w.vm.qmp.command("stop")
        w.stage = "paused"
    except BaseException as e:
        tail = w.vm.log_tail()
        w.discard()
        if isinstance(e, EngineError):
            raise type(e)(f"child {w.id}: {e}\n{tail}") from e
        raise


def become_child(w: Waiting) -> ChildInfo:
    """Restore a waiting process, fix it up (clock, entropy, hostname, network) and ping it:
    then it is a ready child (child.json written). On failure it is discarded."""
    if w.discarded:
        raise VMMError(f"child {w.id}: the waiting process was already discarded")
    t0 = time.monotonic()
    timings: dict[str, float] = {"qmp_up": w.launch_ms}
    info = w.info
    vm = w.vm
    try:
        assert vm.qmp is not None and w.agent is not None
        if w.stage == "paused":
            vm.qmp.command("cont")
        else:
            start_incoming(vm.qmp)
        timings["running"] = w.launch_ms + (time.monotonic() - t0) * 1000
        fixup(w.agent, info.id, w.net)
        timings["fixed_up"] = w.launch_ms + (time.monotonic() - t0) * 1000
        w.agent.ping()
        timings["ready"] = w.launch_ms + (time.monotonic() - t0) * 1000
        if w.pooled:  # it waited in a pool: what the caller waited for is the restore only
            timings = {"prestarted_ms": w.launch_ms,
                       **{k: v - w.launch_ms for k, v in timings.items() if k != "qmp_up"}}
            info.created = time.time()
        w.agent.close()
        w.agent = None
        info.timings_ms = {k: round(v, 1) for k, v in timings.items()}
        info.save()
        (info.path / WAITING_FILE).unlink(missing_ok=True)
        vm.qmp.close()
        vm.qmp = None
        return info
    except BaseException as e:
        tail = vm.log_tail()
        w.discard()
        if isinstance(e, EngineError):
            raise type(e)(f"child {info.id}: {e}\n{tail}") from e
        raise


def _spawn_one(asm: Assembled, ref: str, child_id: str, overlay_tpl: Path,
               memory_limit_mib: int | None, sandbox: bool, with_netns: bool) -> ChildInfo:
    w = launch_waiting(asm, ref, child_id, overlay_tpl, memory_limit_mib, sandbox, with_netns)
    return become_child(w)


def prepare(store: Store, ref: str, *, memory_limit_mib: int | None = None,
            with_netns: bool = False, progress: Progress = _noop) -> tuple[Assembled, bool]:
    """Assemble the snapshot, check it against this host and settle the network option:
    (assembled images, whether each child gets a network namespace)."""
    if memory_limit_mib is not None and memory_limit_mib < 64:
        raise InvalidInput(f"--memory-limit-mib {memory_limit_mib} is too small (>= 64)")
    asm = store.assemble(ref)  # verifies chunks while writing the image: corrupt → no VM
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
    return asm, with_netns


class WaitingSource(Protocol):
    """Where fork takes already started processes from first (engine/pool.py's Pool)."""

    def take(self, ref: str, n: int, *, digest: str, memory_limit_mib: int | None,
             sandbox: bool, with_netns: bool) -> list[Waiting]: ...

    def refill(self, ref: str) -> None: ...


def fork(store: Store, ref: str, n: int, *, memory_limit_mib: int | None = None,
         sandbox: bool = True, with_netns: bool = False, progress: Progress = _noop,
         parallel: int | None = None, pool: WaitingSource | None = None) -> ForkResult:
    """N children of ref. With a pool, its waiting processes for ref are used first (only
    restore + fixup remain for them); the pool refills in the background afterwards."""
    if not isinstance(n, int) or n <= 0 or n > MAX_CHILDREN:
        raise InvalidInput(f"number of children must be between 1 and {MAX_CHILDREN}, got {n}")
    t0 = time.monotonic()
    asm, with_netns = prepare(store, ref, memory_limit_mib=memory_limit_mib,
                              with_netns=with_netns, progress=progress)
    asm_ms = (time.monotonic() - t0) * 1000
    assert asm.disk is not None
    taken: list[Waiting] = []
    if pool is not None:
        taken = pool.take(ref, n, digest=asm.digest, memory_limit_mib=memory_limit_mib,
                          sandbox=sandbox, with_netns=with_netns)
        if taken:
            progress(f"{len(taken)} of {n} from the prewarmed pool")
    ids = [w.id for w in taken] + [_new_id(ref) for _ in range(n - len(taken))]
    results: list[ChildInfo | None] = [None] * n
    errors: list[str] = []
    tpl_dir: Path | None = None
    try:
        overlay = Path()
        if len(taken) < n:
            tpl_dir = children_dir() / f".overlay-{secrets.token_hex(4)}"
            tpl_dir.mkdir()
            overlay = tpl_dir / "empty.qcow2"
            create_overlay(overlay, asm.disk, "raw")
        sem = threading.Semaphore(parallel or min(n, 64))

        def run(i: int) -> None:
            with sem:
                try:
                    if i < len(taken):
                        info = become_child(taken[i])
                    else:
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
        if tpl_dir is not None:
            shutil.rmtree(tpl_dir, ignore_errors=True)
        for i, w in enumerate(taken):
            if results[i] is None:
                w.discard()  # failed (already discarded) or interrupted before its turn
        if pool is not None:  # tops up what was taken, or replaces stale processes
            pool.refill(ref)
    ok = [r for r in results if r is not None]
    if errors and not ok:
        raise VMMError("no child started:\n" + "\n".join(errors[:5]))
    return ForkResult(ok, asm_ms, (time.monotonic() - t0) * 1000, errors)


# ---------------------------------------------------------------- reach children
def _child_dir(child_id: str) -> Path:
    if not isinstance(child_id, str) or not _ID_RE.fullmatch(child_id):
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
