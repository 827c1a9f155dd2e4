"""Fork children from a snapshot and reach them later from any shell.

Each child lives in its own directory under paths.children_dir()/<id>/ with a
child.json describing it; its QEMU runs detached in its own session, so the
command that forked it may exit. Its agent socket accepts one client, a relay
process (agent_client.Relay) that multiplexes any number of requests over it;
requests hold <dir>/lock shared, a branch holds it exclusive.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from forkd.engine import netns
from forkd.engine.accel import AccelVerdict, cached_probe
from forkd.engine.agent_client import (
    PROTOCOL,
    REQUEST_CLIENT,
    AgentClient,
    ExecResult,
    OnData,
    connect_child,
    exec_args,
    guest_b64,
    host_wait,
    splitter,
)
from forkd.engine.commands import (
    check_guest_path,
    check_handle,
    check_mode,
    check_payload,
    check_signal,
    check_timeout,
)
from forkd.engine.disk_budget import DiskBudgetExceeded
from forkd.engine.egress.child import EgressSettings, configure_guest
from forkd.engine.errors import (
    AgentError,
    Busy,
    ChildDead,
    ChildNotFound,
    EngineError,
    HostError,
    TooManyRequests,
    VMMError,
)
from forkd.engine.lazy.failures import failure_of
from forkd.engine.lifecycle import (
    CHILD_FILE,
    ChildVM,
    Lifetime,
    Limits,
    child_dir,
    lock_file,
    new_id,
    private_owner,
    private_tags,
    record_lock,
    require_running,
    step_failed,
)
from forkd.engine.lifecycle import (
    WAITING_FILE as WAITING_FILE,  # re-exported: tests name ch.WAITING_FILE
)
from forkd.engine.lifecycle import (
    ChildInfo as ChildInfo,
)
from forkd.engine.paths import children_dir
from forkd.engine.qemu import CPU_MODEL, MACHINE, QemuVM, create_overlay, pid_alive, qemu_version
from forkd.engine.qmp import QMP
from forkd.errors import Conflict, ForkdError, InvalidInput, NotFound
from forkd.jsondoc import is_integer
from forkd.pack.config import Compat
from forkd.store.store import Assembled, Store

MAX_CHILDREN = 512
Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


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
        problems.append(f"its guest agent speaks protocol {c.agent_protocol}, the host "
                        f"{PROTOCOL} (the agent runs in the snapshot's memory, so a snapshot "
                        "keeps the agent it was built with: rebuild it, or rebuild the "
                        "template it was branched from, with this forkd)")
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


@dataclass
class Waiting:
    """A QEMU process started with `-incoming defer` on one snapshot, its overlay disk, cgroup
    and netns in place, QMP and the agent socket connected and the device state passed:
    `become_child` restores, fixes up and pings it. `discard` removes it (idempotent)."""

    child: ChildVM
    agent: AgentClient | None
    net: dict[str, str] | None
    limits: Limits
    sandbox: bool
    with_netns: bool
    launch_ms: float
    pooled: bool = False
    stage: str = "incoming"  # "incoming": waits for the device state; "paused": restored ahead

    @property
    def id(self) -> str:
        return self.child.id

    @property
    def info(self) -> ChildInfo:
        return self.child.info

    @property
    def vm(self) -> QemuVM:
        assert self.child.vm is not None
        return self.child.vm

    @property
    def discarded(self) -> bool:
        return self.child.cleaned

    def alive(self) -> bool:
        return self.child.alive()

    def discard(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        with contextlib.suppress(EngineError):
            self.child.cleanup()


@contextlib.contextmanager
def _discarded_on_failure(w: Waiting) -> Iterator[None]:
    """A failed step of waiting process ``w`` discards it and raises what
    ``lifecycle.step_failed`` makes of the error."""
    try:
        yield
    except BaseException as e:
        tail = w.vm.log_tail()
        w.discard()
        failed = step_failed(w.id, e, tail)
        if failed is None:
            raise
        raise failed from e


def launch_waiting(asm: Assembled, ref: str, child_id: str, overlay_tpl: Path,
                   limits: Limits, sandbox: bool, with_netns: bool, *,
                   pooled: bool = False, resuming: bool = False) -> Waiting:
    """Start one QEMU waiting for the snapshot's device state (the process-start half of a
    spawn, lifecycle.ChildVM.launch) and connect its agent. pooled: record it in
    waiting.json (owner = this process) instead of child.json, so it is not a child until
    `become_child`."""
    t0 = time.monotonic()
    child = ChildVM.launch(asm, ref, child_id, overlay_tpl, limits, sandbox, with_netns,
                           pooled=pooled, resuming=resuming)
    info = child.info
    net = None
    if info.netns is not None and info.mac and info.ip:
        net = {"ifname": "eth0", "mac": info.mac, "address": info.ip, "gateway": netns.GW_IP}
    w = Waiting(child=child, agent=None, net=net, limits=limits, sandbox=sandbox,
                with_netns=with_netns, launch_ms=0.0, pooled=pooled)
    vm = w.vm
    with _discarded_on_failure(w):
        assert vm.qmp is not None and asm.vmstate is not None
        w.agent = AgentClient(info.path / "agent.sock", alive=vm.alive)  # before the restore
        prepare_incoming(vm.qmp, asm.vmstate)
        w.launch_ms = (time.monotonic() - t0) * 1000
        return w


def restore_ahead(w: Waiting, timeout: float = 60.0) -> None:
    """Restore a waiting process before it is needed, run one throwaway fixup in it (QEMU
    translates the code of the restore and fixup paths now, not on the spawn's critical
    path: ~3x less guest CPU per spawn under TCG) and pause it. Nothing sees the guest
    before `become_child`'s fixup, which adds fresh host entropy, reseeds the CRNG and the
    PRNGs and sets the clock and hostname again, so children stay unique (the throwaway
    fixup only mixes in more entropy). On failure it is discarded."""
    if w.discarded or w.stage != "incoming":
        raise VMMError(f"child {w.id}: not waiting for its device state")
    with _discarded_on_failure(w):
        assert w.vm.qmp is not None and w.agent is not None
        start_incoming(w.vm.qmp, timeout)
        fixup(w.agent, w.id, timeout=timeout)  # no network identity yet: only at the take
        w.agent.ping(timeout)
        w.vm.qmp.command("stop")
        w.stage = "paused"


def become_child(w: Waiting, lifetime: Lifetime | None = None,
                 egress: EgressSettings | None = None) -> ChildInfo:
    """Restore a waiting process, fix it up (clock, entropy, hostname, network) and ping it:
    then it is a ready child (child.json written, with its deadline from lifetime). With
    egress, its proxy starts (while the guest restores) and the guest gets the proxy
    environment, placeholders and CA (egress/child.py). On failure it is discarded."""
    if w.discarded:
        raise VMMError(f"child {w.id}: the waiting process was already discarded")
    t0 = time.monotonic()
    timings: dict[str, float] = {"qmp_up": w.launch_ms}
    info = w.info
    vm = w.vm
    with _discarded_on_failure(w):
        assert vm.qmp is not None and w.agent is not None
        if egress is not None:
            w.child.start_proxy(egress)
        if w.stage == "paused":
            vm.qmp.command("cont")
        else:
            start_incoming(vm.qmp)
        timings["running"] = w.launch_ms + (time.monotonic() - t0) * 1000
        fixup(w.agent, info.id, w.net)
        timings["fixed_up"] = w.launch_ms + (time.monotonic() - t0) * 1000
        if egress is not None:
            w.child.wait_proxy()
            configure_guest(w.agent, egress)
            timings["egress"] = w.launch_ms + (time.monotonic() - t0) * 1000
        w.agent.ping()
        timings["ready"] = w.launch_ms + (time.monotonic() - t0) * 1000
        if w.pooled:  # it waited in a pool: what the caller waited for is the restore only
            timings = {"prestarted_ms": w.launch_ms,
                       **{k: v - w.launch_ms for k, v in timings.items() if k != "qmp_up"}}
            info.created = time.time()
        w.agent.close()
        w.agent = None
        info.timings_ms = {k: round(v, 1) for k, v in timings.items()}
        (lifetime or Lifetime()).apply(info)
        w.child.become_child()
        vm.qmp.close()
        vm.qmp = None
        return info


def _spawn_one(asm: Assembled, ref: str, child_id: str, overlay_tpl: Path, limits: Limits,
               sandbox: bool, with_netns: bool, lifetime: Lifetime | None,
               egress: EgressSettings | None = None) -> ChildInfo:
    w = launch_waiting(asm, ref, child_id, overlay_tpl, limits, sandbox, with_netns)
    return become_child(w, lifetime, egress)


def with_memory(limits: Limits | None, memory_limit_mib: int | None) -> Limits:
    """limits with memory_limit_mib (the older keyword) filled in, checked."""
    limits = limits or Limits()
    if memory_limit_mib is not None:
        if limits.memory_mib not in (None, memory_limit_mib):
            raise InvalidInput("two different memory limits given")
        limits = replace(limits, memory_mib=memory_limit_mib)
    return limits.checked()


def prepare(store: Store, ref: str, *, limits: Limits | None = None,
            with_netns: bool = False, progress: Progress = _noop,
            assembled: Assembled | None = None) -> tuple[Assembled, bool]:
    """Assemble the snapshot (unless ``assembled`` gives its images: the lazy path), check
    it against this host and settle the network option: (assembled images, whether each
    child gets a network namespace)."""
    limits = (limits or Limits()).checked()
    memory_limit_mib = limits.memory_mib
    # verifies chunks while writing the image: corrupt → no VM
    asm = assembled if assembled is not None else store.assemble(ref)
    check_compat(asm, cached_probe())
    assert asm.disk is not None and asm.config.compat is not None and asm.vmstate is not None
    nic = has_nic(asm.vmstate)
    if with_netns and not nic:
        raise InvalidInput(f"{ref} has no network device, so --netns or --egress cannot give "
                           "its children a network; build the recipe with `network = true` "
                           "under [guest]")
    if nic:
        # the saved virtio-net state needs a tap backend (vnet_hdr): every child gets its own
        why = netns.available()
        if why:
            raise HostError(f"{ref} has a network device, so its children need a network "
                            f"namespace + tap, but {why}")
        if not with_netns:
            progress(f"{ref} has a network device: each child gets its own namespace")
            with_netns = True
    if limits.net_kbit is not None and not with_netns:
        raise InvalidInput(f"a network rate limit needs a network: {ref} has no network device "
                           "(build the recipe with `network = true` under [guest])")
    if memory_limit_mib is not None and memory_limit_mib < asm.config.compat.memory_mib:
        progress(f"note: memory limit {memory_limit_mib} MiB is below the guest's "
                 f"{asm.config.compat.memory_mib} MiB")
    return asm, with_netns


class WaitingSource(Protocol):
    """Where fork takes already started processes from first (engine/pool.py's Pool)."""

    def take(self, ref: str, n: int, *, digest: str, limits: Limits,
             sandbox: bool, with_netns: bool) -> list[Waiting]: ...

    def refill(self, ref: str) -> None: ...


def recipe_egress(asm: Assembled) -> EgressSettings | None:
    """The egress the snapshot's recipe gives its forks by default (``[guest] egress``):
    its destinations, none of this host's secrets. A snapshot's config is whoever built it
    (a pack pulled from a hub is anyone's): its recipe naming a host a secret is bound to
    made the host's key usable by that guest (and, with a second host in the recipe, what
    the key reads sent on); a fork that names its egress binds the secrets."""
    entries = list((asm.config.recipe or {}).get("egress") or [])
    return EgressSettings.resolve(entries, with_secrets=False) if entries else None


def check_count(n: object) -> int:
    """A number of children for one fork: 1 to MAX_CHILDREN."""
    if not is_integer(n, 1, MAX_CHILDREN):
        raise InvalidInput(f"number of children must be between 1 and {MAX_CHILDREN}, got {n}")
    return n


def fork(store: Store, ref: str, n: int, *, memory_limit_mib: int | None = None,
         limits: Limits | None = None, lifetime: Lifetime | None = None,
         sandbox: bool = True, with_netns: bool = False, progress: Progress = _noop,
         parallel: int | None = None, pool: WaitingSource | None = None,
         egress: list[str] | None = None, assembled: Assembled | None = None,
         overlay_template: Path | None = None) -> ForkResult:
    """N children of ref. With a pool, its waiting processes for ref are used first (only
    restore + fixup remain for them); the pool refills in the background afterwards.
    limits: per-child resource limits; lifetime: when each child is killed or paused (the
    deadline is in its record; lifetimes.py enforces it). egress: the HOST[:PORT]
    destinations its children may reach through their proxy (None: the recipe's
    defaults; none: no network at all). assembled + overlay_template: the images and the
    empty child overlay to use instead of assembling (engine/lazy/fork.py)."""
    check_count(n)
    limits = with_memory(limits, memory_limit_mib)
    lifetime = (lifetime or Lifetime()).checked()
    t0 = time.monotonic()
    settings = EgressSettings.resolve(egress) if egress else None  # checked before assembly
    asm, with_netns = prepare(store, ref, limits=limits, with_netns=with_netns or bool(egress),
                              progress=progress, assembled=assembled)
    if egress is None:  # not asked: the recipe's defaults; [] asks for none
        settings = recipe_egress(asm)
    if settings is not None and not with_netns:
        raise InvalidInput(f"{ref} has no network device, so its recipe's egress cannot be "
                           "given; build the recipe with `network = true` under [guest]")
    asm_ms = (time.monotonic() - t0) * 1000
    assert asm.disk is not None
    taken: list[Waiting] = []
    if pool is not None:
        taken = pool.take(ref, n, digest=asm.digest, limits=limits, sandbox=sandbox,
                          with_netns=with_netns)
        if taken:
            progress(f"{len(taken)} of {n} from the prewarmed pool")
    ids = [w.id for w in taken] + [new_id(ref) for _ in range(n - len(taken))]
    results: list[ChildInfo | None] = [None] * n
    errors: list[str] = []
    over_budget: list[str] = []  # the children refused by FORKD_DISK_BUDGET
    tpl_dir: Path | None = None
    try:
        overlay = overlay_template or Path()
        if len(taken) < n and overlay_template is None:
            tpl_dir = children_dir() / f".overlay-{secrets.token_hex(4)}"
            tpl_dir.mkdir()
            overlay = tpl_dir / "empty.qcow2"
            create_overlay(overlay, asm.disk, "raw")
        sem = threading.Semaphore(parallel or min(n, 64))

        def run(i: int) -> None:
            with sem:
                try:
                    if i < len(taken):
                        info = become_child(taken[i], lifetime, settings)
                    else:
                        info = _spawn_one(asm, ref, ids[i], overlay, limits, sandbox,
                                          with_netns, lifetime, settings)
                    results[i] = info
                    progress(f"{info.id} ready in {info.timings_ms['ready']:.0f} ms")
                except Exception as e:
                    errors.append(f"{ids[i]}: {e}")
                    if isinstance(e, DiskBudgetExceeded):
                        over_budget.append(ids[i])

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
        # every child refused by the budget: the caller's Conflict (409), not a VM failure
        failed = DiskBudgetExceeded if len(over_budget) == len(errors) else VMMError
        raise failed("no child started:\n" + "\n".join(errors[:5]))
    return ForkResult(ok, asm_ms, (time.monotonic() - t0) * 1000, errors)


# ---------------------------------------------------------------- reach children
def get(child_id: str) -> ChildInfo:
    return ChildInfo.load(child_dir(child_id))


def list_children() -> list[ChildInfo]:
    out = []
    for d in sorted(children_dir().iterdir()):
        if d.name.startswith(".") or not (d / CHILD_FILE).exists():
            continue
        with contextlib.suppress(ChildNotFound, HostError, OSError):
            info = ChildInfo.load(d)
            info.status = info.state()
            out.append(info)
    return out


def locked(info: ChildInfo, timeout: float = 60.0) -> contextlib.AbstractContextManager[None]:
    """No request in flight while this is held (a branch snapshots an idle channel): the
    exclusive side of the request lock; requests hold it shared (``agent``)."""
    busy = f"child {info.id} is busy with a request (a branch waits for requests to end)"
    return lock_file(info.path / "lock", timeout, busy, poll=0.005)


def _requests_allowed(info: ChildInfo, timeout: float = 60.0
                      ) -> contextlib.AbstractContextManager[None]:
    """The shared side of the request lock: any number of requests at once."""
    busy = f"child {info.id} is being branched"
    return lock_file(info.path / "lock", timeout, busy, poll=0.005, shared=True)


_require_running = require_running  # the name engine/branch.py calls


MAX_REQUESTS_PER_CHILD = 16  # requests to one child's agent in flight in one process
MAX_REQUESTS = 32  # requests to any children's agents in flight in one process
# of them one client may hold (REQUEST_CLIENT), in all and to one child: the others
# always keep the rest of each
MAX_REQUESTS_PER_CLIENT = MAX_REQUESTS // 2
MAX_CHILD_REQUESTS_PER_CLIENT = MAX_REQUESTS_PER_CHILD // 2
_in_flight: dict[str, int] = {}
_per_client: dict[str, int] = {}
_per_client_child: dict[str, int] = {}  # "CLIENT CHILD" -> requests
_in_flight_lock = threading.Lock()


@contextlib.contextmanager
def _admitted(child_id: str) -> Iterator[None]:
    """Room for one more request to ``child_id``'s agent in this process, else Busy at
    once (TooManyRequests when its client holds its share). A request holds a thread until
    the guest answers (a command without a timeout: until it ends), so without a bound a
    few commands that never end would hold every worker of a daemon, and its kills,
    listings and spawns with them; and without a share per client one client's commands
    could hold all MAX_REQUESTS, every other client's exec refused until they end."""
    client = REQUEST_CLIENT.get()
    pair = f"{client} {child_id}"
    with _in_flight_lock:
        mine, total = _in_flight.get(child_id, 0), sum(_in_flight.values())
        theirs = _per_client.get(client, 0) if client is not None else 0
        theirs_here = _per_client_child.get(pair, 0) if client is not None else 0
        if theirs >= MAX_REQUESTS_PER_CLIENT or theirs_here >= MAX_CHILD_REQUESTS_PER_CLIENT:
            held, most = ((f"{theirs} requests to sandboxes",
                           f"{MAX_REQUESTS_PER_CLIENT} of {MAX_REQUESTS} in all")
                          if theirs >= MAX_REQUESTS_PER_CLIENT else
                          (f"{theirs_here} requests to {child_id}",
                           f"{MAX_CHILD_REQUESTS_PER_CLIENT} of a sandbox's "
                           f"{MAX_REQUESTS_PER_CHILD}"))
            raise TooManyRequests(
                f"this client ({client}) has {held} in flight here, the most one client may "
                f"({most}): wait for one of yours to end and try again (a command without a "
                "timeout holds its request until it ends; start long ones as background "
                "processes)")
        if mine >= MAX_REQUESTS_PER_CHILD or total >= MAX_REQUESTS:
            held = (f"{mine} requests to child {child_id} (at most {MAX_REQUESTS_PER_CHILD})"
                    if mine >= MAX_REQUESTS_PER_CHILD
                    else f"{total} requests to children (at most {MAX_REQUESTS})")
            raise Busy(f"{held} are in flight here: wait for one to end and try again "
                       "(a command without a timeout holds its request until it ends)")
        _in_flight[child_id] = mine + 1
        if client is not None:
            _per_client[client] = theirs + 1
            _per_client_child[pair] = theirs_here + 1
    try:
        yield
    finally:
        with _in_flight_lock:
            _dec(_in_flight, child_id)
            if client is not None:
                _dec(_per_client, client)
                _dec(_per_client_child, pair)


def _dec(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


@contextlib.contextmanager
def agent(child_id: str, timeout: float = 10.0) -> Iterator[AgentClient]:
    """A client of the child's agent, through its relay (agent_client.connect_child): one
    per concurrent caller, from any process, at most MAX_REQUESTS_PER_CHILD at once per
    child and MAX_REQUESTS in all in one process (Busy beyond)."""
    with _admitted(child_id), _agent(child_id, timeout) as client:
        yield client


@contextlib.contextmanager
def _agent(child_id: str, timeout: float) -> Iterator[AgentClient]:
    info = get(child_id)
    try:
        require_running(info)
    except ChildDead as e:
        failure = failure_of(info.memory, info.pid)  # a lazy child's failed read, if any
        raise ChildDead(f"{e}; {failure}" if failure else str(e)) from None
    with _requests_allowed(info):
        try:
            client = connect_child(info.path, timeout=timeout,
                                   alive=lambda: pid_alive(info.pid))
        except (VMMError, AgentError, OSError) as e:
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


# ---------------------------------------------------------------- commands and code in a child
# The engine API the controller, SDK, CLI and MCP build on (docs/agent-protocol.md, "Host
# API"). Every call opens its own relay connection, so any number run at once per child.
def exec_in(child_id: str, argv: list[str], *, timeout: float | None = None,
            stdin: bytes | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, pty: bool = False) -> dict[str, Any]:
    """Run argv to its end, output collected (32 MiB per stream at most): the agent's
    result (status, exit_code, signal, timed_out, killed, oom_killed, duration, stdout,
    stderr). timeout None: no limit, and the host waits as long as the command runs."""
    if not argv:
        raise InvalidInput("nothing to execute: give a command after --")
    with agent(child_id) as a:
        return a.exec(argv, timeout=timeout, stdin=stdin, env=env, cwd=cwd, pty=pty)


def exec_stream(child_id: str, argv: list[str], *, env: dict[str, str] | None = None,
                cwd: str | None = None, stdin: bytes | None = None,
                timeout: float | None = None, on_stdout: OnData | None = None,
                on_stderr: OnData | None = None, pty: bool = False,
                stop: Callable[[], bool] | None = None) -> ExecResult:
    """Run argv to its end, its output given to on_stdout/on_stderr as it is produced (a
    PTY merges stderr into stdout). Callbacks run on the calling thread. stop: asked
    twice a second; True (the caller is gone) kills the command with its group and raises
    agent_client.Abandoned, as an exception from a callback does."""
    if not argv:
        raise InvalidInput("nothing to execute: give a command after --")
    with agent(child_id) as a:
        res = a.exec(argv, timeout=timeout, stdin=stdin, env=env, cwd=cwd, pty=pty,
                     on_stdout=on_stdout or _drop, on_stderr=on_stderr or _drop, stop=stop)
    return ExecResult.of(res)


def _drop(_: bytes) -> None:
    pass


def process_start(child_id: str, argv: list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, stdin: bytes | None = None,
                  pty: bool = False) -> dict[str, Any]:
    """Start a background process (its own process group): {handle, pid, argv, status,
    running, ...}. Its stdin stays open for process_stdin; its output waits (8 MiB per
    stream, the oldest bytes dropped past that) for process_wait."""
    if not argv:
        raise InvalidInput("nothing to start: give a command")
    args = exec_args(argv, env, cwd, stdin, None, pty)
    with agent(child_id) as a:
        return a.request("proc_start", args)


def process_wait(child_id: str, handle: str, *, timeout: float | None = None,
                 on_stdout: OnData | None = None,
                 on_stderr: OnData | None = None) -> dict[str, Any]:
    """Wait for a background process, up to timeout seconds (None: until it ends). Its
    output so far and while waiting goes to the callbacks (or, with none, into the result's
    stdout/stderr). {running: bool, handle, ...}; once it has ended, also its result
    (status, exit_code, signal, ...) and the handle is forgotten."""
    check_handle(handle)
    check_timeout("timeout", timeout)
    args: dict[str, Any] = {"handle": handle}
    if timeout is not None:
        args["timeout"] = timeout
    stream = on_stdout is not None or on_stderr is not None
    args["stream"] = stream
    with agent(child_id) as a:
        res = a.request("proc_wait", args, timeout=host_wait(timeout),
                        on_event=splitter(on_stdout, on_stderr) if stream else None)
    if not stream:
        for name in ("stdout", "stderr"):
            res[name] = guest_b64(res.get(name), "proc_wait").decode("utf-8", "replace")
    return res


def process_stdin(child_id: str, handle: str, data: bytes, *,
                  close: bool = False) -> dict[str, Any]:
    """Write data to a background process's stdin; close: close it afterwards. Conflict
    when the process has ended or its stdin is closed, NotFound for an unknown handle."""
    check_handle(handle)
    check_payload("stdin", data)
    args = {"handle": handle, "data": base64.b64encode(data).decode(), "close": close}
    with agent(child_id) as a:
        return a.request("proc_stdin", args)


def process_close_stdin(child_id: str, handle: str) -> dict[str, Any]:
    check_handle(handle)
    with agent(child_id) as a:
        return a.request("proc_close_stdin", {"handle": handle})


def process_kill(child_id: str, handle: str, signal: int | str = "SIGKILL") -> dict[str, Any]:
    """Signal the process's whole group (default SIGKILL). Conflict when it has ended."""
    check_handle(handle)
    check_signal(signal)
    with agent(child_id) as a:
        return a.request("proc_kill", {"handle": handle, "signal": signal})


def process_list(child_id: str) -> list[dict[str, Any]]:
    """The background processes the agent knows: running, or ended and not yet waited for."""
    with agent(child_id) as a:
        procs = a.request("proc_list").get("processes")
    if not isinstance(procs, list):
        raise AgentError("the guest agent's answer to proc_list has no list of processes; "
                         "its sandbox may be damaged: kill it")
    return procs


def eval_in(child_id: str, code: str, timeout: float | None = 300.0) -> dict[str, Any]:
    with agent(child_id) as a:
        return a.eval(code, timeout=timeout)


def run_code(child_id: str, code: str, *, timeout: float | None = 300.0,
             on_stdout: OnData | None = None,
             on_stderr: OnData | None = None) -> dict[str, Any]:
    """A code-interpreter cell in the warm namespace: {results: [{text, png?, html?, ...,
    is_main_result}], stdout, stderr, error: null | {type, message, traceback}, value, repr}
    (the shape of E2B's code interpreter; docs/agent-protocol.md)."""
    with agent(child_id) as a:
        return a.run_code(code, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr)


def read_file(child_id: str, path: str) -> bytes:
    """A guest file's bytes (streamed; up to 4 GiB). NotFound when it does not exist."""
    parts: list[bytes] = []
    read_file_chunks(child_id, path, parts.append)
    return b"".join(parts)


def read_file_chunks(child_id: str, path: str, on_chunk: OnData,
                     stop: Callable[[], bool] | None = None) -> int:
    """A guest file's bytes given to ``on_chunk`` as they arrive (up to 4 GiB; a daemon
    passes them on without holding the file); its size. NotFound before any chunk when it
    does not exist; an exception from ``on_chunk``, or ``stop`` saying True while no chunk
    comes (a FIFO nobody writes), ends the transfer."""
    check_guest_path(path)
    with agent(child_id) as a:
        return a.get_chunks(path, on_chunk, stop=stop)


def write_file(child_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
    """Write a guest file (up to 32 MiB; its directories are made), checked first."""
    check_guest_path(path)
    check_payload("the file", data)
    check_mode(mode)
    with agent(child_id) as a:
        a.put(path, data, mode)


KILL_WAITS_FOR_BRANCH = 30.0  # seconds a kill lets a branch in flight finish its copy


@contextlib.contextmanager
def _branch_ended(d: Path) -> Iterator[None]:
    """Wait up to KILL_WAITS_FOR_BRANCH for a branch of the child in ``d`` to release the
    request lock (its exclusive side; requests hold it shared and are not waited for), and
    keep new branches out while the block runs. A branch still holding it then (QEMU
    wedged) is not waited for: it fails, saying its child ended (engine/branch.py)."""
    busy = f"child {d.name} is being branched"
    with contextlib.ExitStack() as held:
        with contextlib.suppress(Busy):  # only the wait: a Busy of the block is the block's
            held.enter_context(lock_file(d / "lock", KILL_WAITS_FOR_BRANCH, busy, poll=0.005,
                                         shared=True))
        yield


def refuse_saved_state(tag: str) -> None:
    """Conflict when ``tag`` is a sandbox's saved state (its private tag, the sandbox still
    there): its resume would have nothing to start from. Given to Store.remove (``refuse``)
    by every removal of tags (the daemon's DELETE /v1/snapshots, `forkd rmi`), which calls
    it under the tags' lock that a pause's save takes: a check made before the lock let a
    sandbox pause onto the layer between the check and a cascade's removal, whose saved
    state the cascade then removed."""
    owner = private_owner(tag)
    if owner is not None and child_exists(owner):
        raise Conflict(
            f"{tag} is the saved state of sandbox {owner}; kill it (its saved state goes "
            "with it) or resume it first"
        )


def child_exists(child_id: str) -> bool:
    try:
        get(child_id)
    except (InvalidInput, NotFound):
        return False
    return True


def kill(child_id: str, store: Store | None = None) -> ChildInfo:
    """Stop the child's QEMU and remove everything it had (lifecycle.ChildVM.end); a paused
    child's saved state (its private tags, in store, default $FORKD_HOME's) goes too. Safe
    on crashed children. Under the child's record lock: a pause, resume or extend in flight
    ends first (a kill that cut a resume short removed the directory a new QEMU was being
    started in, and left that QEMU, its netns and cgroup running; one that cut a pause
    short left its private tag in the store), then the kill acts on what it left. A branch
    in flight may finish first too (``_branch_ended``): its layer is then whole."""
    d = child_dir(child_id)
    with _branch_ended(d), record_lock(d):
        child = ChildVM.adopt(d)
        info = child.info
        was = child.end()
    if info.paused_tag is not None or info.ref in private_tags(info.id):
        drop_private_tags(info, store or Store.open())
    info.status = {"running": "killed", "paused": "killed"}.get(was, "crashed")
    return info


def drop_private_tags(info: ChildInfo, store: Store) -> None:
    """Remove a paused (or resumed) child's private tags from the store ($FORKD_HOME), the
    current one first; a tag some other layer was branched from is kept. The layers they
    named go with the next `forkd gc`."""
    tags = sorted(private_tags(info.id), key=lambda t: t != info.ref)
    for tag in tags:
        with contextlib.suppress(ForkdError):
            store.remove(tag)


def of_store(memory: str, store: Store) -> bool:
    """Whether a child whose record names ``memory`` was forked from ``store``: its memory
    image is one the store assembled (under its home). Children of other stores may share
    the run directory ($FORKD_RUN is /run/forkd for every root user)."""
    return Path(memory).resolve().is_relative_to(store.home.resolve())


def kill_all(store: Store | None = None) -> list[ChildInfo]:
    """Kill every child forked from ``store`` (default $FORKD_HOME's), none of another's."""
    store = store or Store.open()
    out = []
    for c in list_children():
        if of_store(c.memory, store):
            with contextlib.suppress(ChildNotFound):
                out.append(kill(c.id, store))
    return out
