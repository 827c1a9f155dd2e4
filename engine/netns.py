"""A network namespace + tap per VM (pyroute2), the same host side in every namespace.

Every namespace `forkd-<id>` holds `tap0` with the same gateway MAC and address
(GW_MAC, GW_IP/16): the guest's cached ARP entry for its gateway stays valid
after a restore, children cannot reach each other or the host's networks by
construction. The guest gets its own MAC and IP from the agent's `fixup` (see
docs/agent-protocol.md); the host reaches it through sockets opened by a thread
that entered the namespace (`entered()`).

Namespaces are per *thread* here: setns(CLONE_NEWNET) switches only the calling
thread, a process started from that thread (QEMU) is born inside, and pyroute2
IPRoute objects stay bound to the namespace they were opened in.

The tap is created by this process's own descriptor, which is kept and handed to the
namespace's QEMU (``take_tap``; QEMU's ``-netdev tap,fd=N``) rather than closed. A tap takes
one queue: a QEMU that attached it by name (TUNSETIFF) failed with "Device or resource busy"
whenever a process forked meanwhile by another thread (a sibling child's QEMU, tc, iptables)
still held a copy of the creating descriptor, not yet exec'd: one child in ten of a
langgraph-react fan-out on a loaded host. A copy of the kept descriptor is that same queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import ipaddress
import os
import shutil
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from forkd.engine.errors import HostError

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
PREFIX = "forkd-"
GW_IP, GW_PREFIX, GW_MAC = "10.200.0.1", 16, "02:00:0a:c8:00:01"
TEMPLATE_IP, TEMPLATE_MAC = "10.200.0.2", "52:54:00:c8:00:02"
TAP = "tap0"
TUN_DEVICE = "/dev/net/tun"
TUNSETIFF, TUNSETPERSIST = 0x400454CA, 0x400454CB
# QEMU's own defaults for a tap it opens: no packet information, virtio-net headers
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_libc = ctypes.CDLL(None, use_errno=True)
_taps: dict[str, int] = {}  # namespace -> the descriptor that created its tap, for its QEMU
_taps_lock = threading.Lock()


def available() -> str | None:
    """None when netns + tap can be used here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing (modprobe tun)"
    try:
        importlib.import_module("pyroute2")
    except ImportError:
        return "pyroute2 is not installed (pip install pyroute2)"
    return None


def child_identity(child_id: str) -> tuple[str, str]:
    """(MAC, IP/prefix) for a child: locally administered MAC, address in 10.200/16."""
    h = zlib.crc32(child_id.encode())
    mac = "02:c1:" + ":".join(f"{(h >> s) & 255:02x}" for s in (24, 16, 8, 0))
    host = 256 + h % (65536 - 512)  # never .0.x (gateway, template) nor the broadcast
    ip = ipaddress.ip_address(GW_IP) - 1 + host
    return mac, f"{ip}/{GW_PREFIX}"


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise HostError(f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the block with the calling thread inside netns `name`."""
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        os.close(saved)
        raise HostError(f"network namespace {name} does not exist") from e
    try:
        _setns(fd)
        yield
    finally:
        _setns(saved)
        os.close(saved)
        os.close(fd)


def create(name: str) -> None:
    """Namespace `name` with lo up and tap0 (GW_MAC, GW_IP/16, up); IPv6 off. The tap's
    descriptor is kept for the namespace's QEMU (``take_tap``) until ``remove``."""
    if not name.startswith(PREFIX):
        raise HostError(f"refusing to manage namespace {name!r} (not {PREFIX}*)")
    IPRoute = importlib.import_module("pyroute2").IPRoute
    netns = importlib.import_module("pyroute2.netns")

    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise HostError(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        netns.attach(name, "thread-self")
        for k in ("default", "all"):
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/net/ipv6/conf/{k}/disable_ipv6").write_text("1")
        ipr = IPRoute()
        try:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            tap_fd = _open_tap()
            with _taps_lock:
                _taps[name] = tap_fd
            tap = ipr.link_lookup(ifname=TAP)[0]
            ipr.link("set", index=tap, address=GW_MAC)
            ipr.link("set", index=tap, state="up")
            ipr.addr("add", index=tap, address=GW_IP, prefixlen=GW_PREFIX)
        finally:
            ipr.close()
    except BaseException:
        _setns(saved)
        with contextlib.suppress(Exception):
            remove(name)
        raise
    finally:
        _setns(saved)
        os.close(saved)


def _open_tap() -> int:
    """A persistent tap0 in the calling thread's namespace, and the descriptor attached to it
    as its queue (close-on-exec)."""
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    try:
        ifreq = struct.pack("16sH22x", TAP.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifreq)
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    except OSError as e:
        os.close(fd)
        raise HostError(f"cannot create {TAP} ({TUN_DEVICE}): {e}; is the tun module "
                        "loaded (modprobe tun)?") from e
    return fd


def take_tap(name: str) -> int | None:
    """The descriptor of namespace `name`'s tap, for the QEMU about to start in it (the
    caller closes it once QEMU has it); None when this process did not create the
    namespace or a QEMU took it already (QEMU then attaches the tap by name)."""
    with _taps_lock:
        return _taps.pop(name, None)


def _release_tap(name: str) -> None:
    fd = take_tap(name)
    if fd is not None:
        os.close(fd)


MIN_RATE_KBIT, MAX_RATE_KBIT = 64, 100_000_000  # 64 kbit/s .. 100 Gbit/s


def _tc(args: list[str]) -> None:
    p = subprocess.run(["tc", *args], capture_output=True, text=True, check=False,
                       stdin=subprocess.DEVNULL, timeout=20)
    if p.returncode != 0:
        raise HostError(f"tc {' '.join(args)} failed: {p.stderr.strip()}")


def limit_rate(name: str, kbit: int) -> None:
    """Cap what tap0 of namespace `name` carries to the guest at kbit/s: a token bucket
    (tbf, burst max(16 KiB, 100 ms at the rate), latency 100 ms) on the tap's egress. What
    the guest sends reaches only the host side of its own namespace (nothing routes
    further), so there is nothing to cap there; an ingress policer would also need the
    kernel's act_police, which hosts like this one lack."""
    if not name.startswith(PREFIX):
        raise HostError(f"refusing to manage namespace {name!r} (not {PREFIX}*)")
    if shutil.which("tc") is None:
        raise HostError("tc is missing (apt-get install -y iproute2); it limits the network rate")
    burst = max(16 << 10, kbit * 1000 // 8 // 10)
    with entered(name):
        _tc(["qdisc", "add", "dev", "tap0", "root", "tbf", "rate", f"{kbit}kbit",
             "burst", str(burst), "latency", "100ms"])


def _iptables(args: list[str]) -> None:
    p = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True,
                       check=False, stdin=subprocess.DEVNULL, timeout=20)
    if p.returncode != 0:
        raise HostError(f"iptables {' '.join(args)} failed: {p.stderr.strip()}")


def redirect_stray_tcp(name: str, proxy_port: int, refusal_port: int) -> None:
    """In namespace ``name``, send every TCP connection the guest opens that is not to the
    proxy (GW_IP:proxy_port) to GW_IP:refusal_port instead (nat REDIRECT), where the proxy
    refuses and audits it with its original destination (SO_ORIGINAL_DST)."""
    if not name.startswith(PREFIX):
        raise HostError(f"refusing to manage namespace {name!r} (not {PREFIX}*)")
    if shutil.which("iptables") is None:
        raise HostError("iptables is missing (apt-get install -y iptables); egress needs it to "
                        "refuse and audit connections that bypass the proxy")
    with entered(name):
        _iptables(["-t", "nat", "-A", "PREROUTING", "-i", "tap0", "-p", "tcp", "-d", GW_IP,
                   "--dport", str(proxy_port), "-j", "RETURN"])
        _iptables(["-t", "nat", "-A", "PREROUTING", "-i", "tap0", "-p", "tcp",
                   "-j", "REDIRECT", "--to-ports", str(refusal_port)])


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def remove(name: str) -> None:
    """Remove the namespace (its tap goes with it). Idempotent."""
    _release_tap(name)
    if not exists(name):
        return
    netns = importlib.import_module("pyroute2.netns")

    try:
        netns.remove(name)
    except OSError as e:
        if exists(name):
            raise HostError(f"cannot remove network namespace {name}: {e}") from e
