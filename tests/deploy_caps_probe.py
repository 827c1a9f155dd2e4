"""What forkd.service's daemon does with privileges, step by step, for tests/test_deploy_units.py.

Run as root under a restricted capability bounding set (``setpriv --bounding-set``): makes
a child's network namespace with its tap (forkd.engine.netns), the egress iptables rules
and a tc rate limit in it, a cgroup with memory and pids limits, starts a QEMU that drops
to an unprivileged user with -runas inside the namespace and cgroup, signals it, and
removes everything. Prints ``ok`` and exits 0 when every step worked; a failing step's
error ends it with a non-zero status. Whatever it made is removed either way.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forkd.engine import netns
from forkd.engine.cgroup import CgroupLimits, ChildCgroup
from forkd.engine.qemu import QEMU


def start_qemu(d: Path, name: str, user: str) -> subprocess.Popen[bytes]:
    """A QEMU with no machine, paused, that drops to ``user``; started inside netns ``name``.
    Its memory backend is a read-only (0444) file opened copy-on-write, as a child's
    assembled memory image is (QEMU opens it O_RDWR with share=off)."""
    qmp = d / "qmp.sock"
    memory = d / "memory.img"
    memory.write_bytes(bytes(1 << 20))
    memory.chmod(0o444)
    argv = [QEMU, "-machine", "none", "-nodefaults", "-display", "none", "-S",
            "-object", f"memory-backend-file,id=mem,size=1M,mem-path={memory},share=off",
            "-sandbox", "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny",
            "-runas", user, "-qmp", f"unix:{qmp},server=on,wait=off"]
    with netns.entered(name):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        if qmp.exists() and _uid(proc.pid) == pwd.getpwnam(user).pw_uid:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(qmp))  # QEMU answers after the privilege drop
                if s.recv(4096).startswith(b'{"QMP"'):
                    return proc
        time.sleep(0.05)
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise RuntimeError(f"QEMU -runas {user} did not come up: {err.decode(errors='replace')}")


def quit_qemu(proc: subprocess.Popen[bytes], qmp: Path) -> None:
    """End our QEMU even without CAP_KILL (it runs as another user): QMP ``quit``."""
    if proc.poll() is not None:
        return
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(qmp))
            s.recv(4096)
            s.sendall(b'{"execute": "qmp_capabilities"}\n')
            s.recv(4096)
            s.sendall(b'{"execute": "quit"}\n')
            s.recv(4096)
    except OSError:
        proc.kill()
    proc.wait(timeout=10)


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Uid line for pid {pid}")


def main() -> int:
    name = f"forkd-captest{os.getpid()}"
    netns.create(name)
    cgroup: ChildCgroup | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        netns.redirect_stray_tcp(name, 3128, 3129)
        netns.limit_rate(name, 10_000)
        cgroup = ChildCgroup.create(name, CgroupLimits(memory_mib=256, pids=64))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                proc = start_qemu(Path(tmp), name, os.environ.get("FORKD_QEMU_USER", "nobody"))
                cgroup.add(proc.pid)
                os.kill(proc.pid, 9)  # QEMU now runs as another user: needs CAP_KILL
                proc.wait(timeout=10)
            finally:
                if proc is not None:
                    quit_qemu(proc, Path(tmp) / "qmp.sock")
    finally:
        try:
            if cgroup is not None:
                cgroup.remove()
        finally:
            netns.remove(name)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
