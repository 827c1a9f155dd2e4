"""`forkd doctor`: can this host build and fork VMs? Each failure carries a fix hint."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from forkd.engine.accel import FORCE_ENV, probe, probe_command
from forkd.engine.cgroup import detect
from forkd.engine.errors import HostError
from forkd.engine.netns import available as netns_available
from forkd.engine.qemu import QEMU, QEMU_IMG, qemu_version, unprivileged_user
from forkd.errors import ForkdError
from forkd.private import open_to_others

TMPFS_MAGIC = 0x01021994


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail, info
    detail: str
    hint: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _fs_kind(path: Path) -> str:
    p = path
    while not p.exists():
        p = p.parent
    best = ("", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, kind = parts[1], parts[2]
            real = str(p.resolve())
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, kind)
    return best[1]


def _tool(name: str, pkg: str) -> Check:
    path = shutil.which(name)
    if path:
        return Check(name, "ok", path)
    return Check(name, "fail", f"{name} not found", f"apt-get install -y {pkg}")


def _accelerator() -> Check:
    """The accelerator verdict, probed now (doctor never reads or writes the probe cache)."""
    try:
        v = probe()
    except HostError as e:  # FORKD_ACCEL holds something else than kvm or tcg
        return Check("accelerator", "fail", str(e), f"unset {FORCE_ENV} or set it to kvm or tcg")
    detail = f"{v.accel}: {v.reason}"
    if v.outcome == "failed":
        return Check("accelerator", "warn", detail,
                     "forks and builds use TCG until a probe succeeds (a failed probe is not "
                     f"cached); check that `{' '.join(probe_command())}` prints a measurement, "
                     f"or set {FORCE_ENV}=kvm|tcg")
    if v.outcome == "forced":
        if v.accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
            return Check("accelerator", "warn", detail + "; /dev/kvm is missing or not "
                         "accessible, QEMU cannot start with -accel kvm",
                         f"unset {FORCE_ENV} to let the probe decide, or give this user /dev/kvm")
        return Check("accelerator", "ok", detail)
    return Check("accelerator", "ok", detail,
                 "" if v.accel == "kvm" else "TCG works everywhere but is slower; on a host "
                 "with native KVM the probe picks kvm")


def _default_hub() -> Check:
    """Where `forkd pull NS/NAME` goes: $FORKD_HUB, else the client config, else nowhere."""
    from forkd.registry.reference import SET_HUB_HINT, resolve_default_hub

    try:
        chosen = resolve_default_hub()
    except ForkdError as e:
        return Check("default-hub", "warn", str(e), f"fix it with {SET_HUB_HINT}")
    if chosen is None:
        return Check("default-hub", "info", "none: pull and push need HUB/NS/NAME until "
                     f"FORKD_HUB is exported or {SET_HUB_HINT} is run",
                     f"export FORKD_HUB=HOST[:PORT] or run {SET_HUB_HINT}")
    return Check("default-hub", "ok", f"{chosen.hub.url} (from {chosen.source})")


def run(store_home: Path | None = None, *, check_store: bool = True) -> list[Check]:
    checks: list[Check] = []
    # QEMU
    try:
        v = qemu_version()
        checks.append(Check("qemu", "ok", f"{shutil.which(QEMU) or QEMU} {v}"))
        out = subprocess.run([QEMU, "-machine", "help"], capture_output=True, text=True,
                             timeout=20, stdin=subprocess.DEVNULL, check=False).stdout
        if "microvm" in out:
            checks.append(Check("machine", "ok", "microvm available"))
        else:
            checks.append(Check("machine", "fail", "this QEMU has no microvm machine",
                                "install Debian's qemu-system-x86 (>= 5.0)"))
        sb = subprocess.run([QEMU, "-sandbox", "help"], capture_output=True, text=True,
                            timeout=20, stdin=subprocess.DEVNULL, check=False)
        if "no option group" in (sb.stderr + sb.stdout) or "invalid option" in sb.stderr:
            checks.append(Check("sandbox", "warn", "QEMU was built without seccomp (-sandbox)",
                                "use a QEMU built with libseccomp; children run unsandboxed"))
        else:
            checks.append(Check("sandbox", "ok", "-sandbox on (seccomp) supported"))
    except HostError as e:
        checks.append(Check("qemu", "fail", str(e), "apt-get install -y qemu-system-x86"))
    checks.append(_tool(QEMU_IMG, "qemu-utils"))
    user = unprivileged_user()
    checks.append(Check("qemu-user", "ok" if user else "warn",
                        f"children's QEMU drops to user {user!r} (-runas)" if user else
                        "children's QEMU keeps the caller's user",
                        "" if user else "run forkd as root with a `nobody` user (or set "
                        "FORKD_QEMU_USER) so QEMU can drop privileges"))
    checks.append(_accelerator())
    # memory files (assembled images in the store cache; builds on /dev/shm)
    from forkd.store.store import default_home
    home = store_home or default_home()
    mem_dir = home / "cache"
    probe_dir = mem_dir if mem_dir.exists() else home if home.exists() else home.parent
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    st = os.statvfs(probe_dir)
    free = st.f_bavail * st.f_frsize
    kind = _fs_kind(probe_dir)
    checks.append(Check("memory-files", "ok" if free > (2 << 30) else "warn",
                        f"{mem_dir} on {kind}, {free / 2**30:.1f} GiB free",
                        "" if free > (2 << 30) else "free space: each snapshot's assembled "
                        "memory image is as large as the guest RAM"))
    checks.append(_store_access(home))
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        s2 = os.statvfs(shm)
        checks.append(Check("build-tmpfs", "ok",
                            f"/dev/shm tmpfs, {s2.f_bavail * s2.f_frsize / 2**30:.1f} GiB free"))
    else:
        checks.append(Check("build-tmpfs", "warn", "/dev/shm not writable",
                            "templates write their memory files to $FORKD_RUN instead (slower)"))
    # cgroups
    cg = detect()
    if cg is None:
        checks.append(Check("cgroup", "warn", "no cgroup memory controller found",
                            "mount cgroup2 with +memory (or v1 memory) for --memory-limit-mib"))
    else:
        writable = os.access(cg[1], os.W_OK)
        checks.append(Check("cgroup", "ok" if writable else "warn",
                            f"{cg[0]} memory controller at {cg[1]}"
                            + ("" if writable else " (not writable)"),
                            "" if writable else "run as root for --memory-limit-mib"))
    # networking
    why = netns_available()
    checks.append(Check("netns-tap", "ok" if why is None else "warn",
                        "network namespaces + tap usable (pyroute2, /dev/net/tun)" if why is None
                        else why,
                        "" if why is None else "needed only for `forkd fork --netns`: run as "
                        "root with /dev/net/tun and pyroute2 installed"))
    iptables = shutil.which("iptables")
    checks.append(Check("iptables", "ok" if iptables else "warn",
                        iptables or "iptables not found",
                        "" if iptables else "needed only for `forkd fork --egress` (it refuses "
                        "and audits connections that bypass the proxy): apt-get install -y "
                        "iptables"))
    # guest build tools
    for name, pkg in (("debootstrap", "debootstrap"), ("dpkg-deb", "dpkg"),
                      ("apt-get", "apt"), ("cpio", "cpio"), ("mkfs.ext4", "e2fsprogs"),
                      ("lz4", "lz4")):
        checks.append(_tool(name, pkg))
    # guest kernel
    try:
        out = subprocess.run(["apt-cache", "depends", "linux-image-cloud-amd64"],
                             capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL, check=False).stdout
        if "linux-image-" in out:
            dep = [w for w in out.split() if w.startswith("linux-image-6")
                   or w.startswith("linux-image-5")]
            checks.append(Check("guest-kernel", "ok",
                                f"linux-image-cloud-amd64 → {dep[0] if dep else '?'}"))
        else:
            checks.append(Check("guest-kernel", "fail", "apt does not know "
                                "linux-image-cloud-amd64", "apt-get update (Debian main)"))
    except (OSError, subprocess.TimeoutExpired) as e:
        checks.append(Check("guest-kernel", "fail", f"apt-cache failed: {e}",
                            "run on Debian/Ubuntu with apt"))
    if os.geteuid() != 0:
        checks.append(Check("privileges", "warn", "not root",
                            "guest builds (debootstrap, chroot), cgroups and branch "
                            "(process_vm_readv) need root"))
    checks.append(_default_hub())
    # store
    if check_store:
        try:
            from forkd.store.store import Store
            problems = Store.open(store_home).verify()
            checks.append(Check("store", "ok" if not problems else "fail",
                                f"{home}: " + ("all blobs and chains verified" if not problems
                                               else f"{len(problems)} problem(s): {problems[0]}"),
                                "" if not problems else "`forkd rmi` the broken tag or pull it "
                                "again, then `forkd gc`"))
        except ForkdError as e:
            checks.append(Check("store", "fail", str(e), "check $FORKD_HOME"))
    return checks


def _store_access(home: Path) -> Check:
    """A store others may read gives them every stored snapshot's memory: whatever the
    guests held in it (an agent's keys, a session's data). A new store is made 0700; one
    made before, or under a chosen $FORKD_HOME, may not be."""
    opened = open_to_others(home)
    if opened is None:
        return Check("store-access", "ok", f"{home}: only its owner may read it")
    return Check("store-access", "warn", f"{home}: {opened}, and it holds snapshots' memory",
                 f"chmod 700 {home}")


def verdict(checks: list[Check]) -> bool:
    return all(c.status != "fail" for c in checks)
