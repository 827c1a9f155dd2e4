"""Limits beyond memory, biting on real VMs of the tiny recipe: CPU time (cgroup cpu), disk
I/O (QEMU's drive throttling), host pids of the QEMU (pids cgroup). Ratios against a
control child in the same run, never absolute timings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forkd.engine import cgroup as cg
from forkd.engine import children as ch
from forkd.engine.lifecycle import ChildVM, Limits
from forkd.store.store import Store

pytestmark = pytest.mark.vm

BUSY = "import time\n_t = time.time() + {s}\nwhile time.time() < _t:\n    pass"


def _cgroup(child: ch.ChildInfo) -> cg.ChildCgroup:
    c = ChildVM.adopt(child.path).cgroup
    assert c is not None
    return c


def test_cpu_limit_caps_a_busy_guest_at_its_share(store: Store, tiny: str,
                                                  cleanup_children: None) -> None:
    """A busy loop (in the warm interpreter: no start-up to pay at a tenth of a core) in a
    child limited to 0.1 CPU uses <= ~0.1 CPU (cgroup CPU usage vs wall time); the same loop
    in a control child allowed 2 CPUs, run at the same time, uses more (a low limit, so the
    control gets more even on a host loaded with other VMs)."""
    limited = ch.fork(store, tiny, 1, limits=Limits(cpus=0.1)).children[0]
    control = ch.fork(store, tiny, 1, limits=Limits(cpus=2.0)).children[0]
    lim_cg, ctl_cg = _cgroup(limited), _cgroup(control)
    if lim_cg.version == "v1":
        assert (lim_cg.paths["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert (lim_cg.paths["cpu"] / "cpu.cfs_period_us").read_text().strip() == "100000"
    else:
        assert (lim_cg.path / "cpu.max").read_text().split() == ["10000", "100000"]
    seconds = 8
    busy = BUSY.format(s=seconds)
    share: dict[str, float] = {}

    def run(child: ch.ChildInfo, group: cg.ChildCgroup) -> None:
        """CPU share of one child over its own exec (each ends when its loop does)."""
        used0, t0 = group.cpu_usage_ns(), time.monotonic()
        assert ch.eval_in(child.id, busy, timeout=600)["error"] is None
        share[child.id] = (group.cpu_usage_ns() - used0) / 1e9 / (time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(c, g))
               for c, g in ((limited, lim_cg), (control, ctl_cg))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert share[limited.id] <= 0.1 * 1.25, share
    assert share[control.id] >= 2 * share[limited.id], share


def _dd_seconds(child_id: str, mib: int) -> float:
    cmd = (f"dd if=/dev/zero of=/root/dd.bin bs=64k count={mib * 16} oflag=direct 2>&1; "
           "rm -f /root/dd.bin")
    t0 = time.monotonic()
    r = ch.exec_in(child_id, ["sh", "-c", cmd], timeout=300)
    assert r["exit_code"] == 0, r
    return time.monotonic() - t0


def test_disk_limit_throttles_dd(store: Store, tiny: str, cleanup_children: None) -> None:
    """dd of 8 MiB with O_DIRECT in a child throttled to 1 MiB/s takes several times as long
    as in an unthrottled child of the same run."""
    throttled = ch.fork(store, tiny, 1, limits=Limits(disk_bps=1 << 20, disk_iops=2000)).children[0]
    free = ch.fork(store, tiny, 1).children[0]
    cmd = Path(f"/proc/{throttled.pid}/cmdline").read_bytes()
    assert b"throttling.bps-total=1048576" in cmd and b"throttling.iops-total=2000" in cmd
    fast = _dd_seconds(free.id, 8)
    slow = _dd_seconds(throttled.id, 8)
    assert slow >= 3 * fast, (slow, fast)


def test_pids_limit_refuses_tasks_past_it(store: Store, tiny: str, cleanup_children: None) -> None:
    """The child's QEMU runs in a pids cgroup with the limit; a task of that cgroup cannot
    fork past it (the kernel answers EAGAIN)."""
    child = ch.fork(store, tiny, 1, limits=Limits(pids=64)).children[0]
    g = _cgroup(child)
    pids_dir = g.paths["pids"]
    assert (pids_dir / "pids.max").read_text().strip() == "64"
    assert child.pid in [int(x) for x in (pids_dir / "cgroup.procs").read_text().split()]
    qemu_tasks = int((pids_dir / "pids.current").read_text())
    assert 1 <= qemu_tasks < 64
    # a helper joins the child's pids cgroup and forks until the kernel refuses
    helper = (
        "import os, sys, time\n"
        f"open('{pids_dir}/cgroup.procs', 'w').write(str(os.getpid()))\n"
        "kids = []\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        kids.append(pid)\n"
        "    print('no limit', len(kids))\n"
        "except BlockingIOError:\n"
        "    print('refused', len(kids))\n"
        "for k in kids:\n"
        "    os.kill(k, 9); os.waitpid(k, 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True,
                         timeout=60, cwd="/").stdout.split()
    assert out[0] == "refused" and int(out[1]) < 64, out
    assert ch.exec_in(child.id, ["true"])["exit_code"] == 0  # the child itself runs on


@pytest.mark.skipif(cg.v2_controllers() == set(), reason="this host has no cgroup v2 "
                    "hierarchy at /sys/fs/cgroup (v1 here); the v2 path needs one")
def test_v2_limits_are_written_where_the_host_has_v2(store: Store, tiny: str,
                                                     cleanup_children: None) -> None:
    child = ch.fork(store, tiny, 1, limits=Limits(memory_mib=1024, cpus=0.5, pids=128)).children[0]
    g = _cgroup(child)
    assert g.version == "v2"
    assert (g.path / "cpu.max").read_text().split() == ["50000", "100000"]
    assert (g.path / "pids.max").read_text().strip() == "128"
    assert int((g.path / "memory.max").read_text()) == 1024 << 20
    assert g.cpu_usage_ns() > 0


def test_limits_leave_nothing_behind(store: Store, tiny: str) -> None:
    child = ch.fork(store, tiny, 1, limits=Limits(cpus=1.0, pids=256, memory_mib=1024)).children[0]
    dirs = list(_cgroup(child).paths.values())
    assert all(d.is_dir() for d in dirs)
    ch.kill(child.id)
    assert not any(d.exists() for d in dirs)
    assert not os.path.exists(child.dir)


@pytest.fixture(scope="module")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available()
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    return build(store, recipe.parse(text, src="tiny+network"), "tiny-net:limits").ref


RECEIVE = ("import socket\ns = socket.create_connection(('{gw}', 7100), timeout=120)\n"
           "n = 0\nwhile chunk := s.recv(65536):\n    n += len(chunk)\nprint(n)")


def _download_seconds(child: ch.ChildInfo, nbytes: int) -> float:
    """Seconds for the host side of the child's tap to send nbytes over TCP to the guest
    (until the guest has read them all and closed)."""
    from forkd.engine import netns

    assert child.netns is not None
    got: dict[str, float] = {}
    ready = threading.Event()

    def send() -> None:
        with netns.entered(child.netns or ""):
            srv = socket.socket()
        with srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((netns.GW_IP, 7100))
            srv.listen(1)
            srv.settimeout(120)
            ready.set()
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(120)
                t0 = time.monotonic()
                conn.sendall(b"x" * nbytes)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(4096):
                    pass
                got["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=send)
    t.start()
    ready.wait(30)
    r = ch.exec_in(child.id, ["python3", "-c", RECEIVE.format(gw=netns.GW_IP)], timeout=300)
    t.join(150)
    assert r["exit_code"] == 0 and r["stdout"].strip() == str(nbytes), r
    return got["seconds"]


def test_network_limit_throttles_the_tap(store: Store, tiny_net: str,
                                         cleanup_children: None) -> None:
    """1 MiB sent to the guest over TCP through a tap limited to 2000 kbit/s takes several
    times as long as through an unlimited tap of the same run."""
    from forkd.engine import netns

    limited = ch.fork(store, tiny_net, 1, limits=Limits(net_kbit=2000)).children[0]
    free = ch.fork(store, tiny_net, 1).children[0]
    assert limited.netns is not None
    with netns.entered(limited.netns):
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", "tap0"], capture_output=True,
                                text=True, check=True).stdout
    assert "tbf" in qdiscs and "rate 2Mbit" in qdiscs, qdiscs
    fast = _download_seconds(free, 1 << 20)
    slow = _download_seconds(limited, 1 << 20)
    assert slow >= 3 * fast, (slow, fast)
    assert slow >= (1 << 20) * 8 / 2_000_000 * 0.5, slow  # not faster than ~2x the rate
