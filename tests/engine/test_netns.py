"""Children with their own network namespace, tap, MAC and IP (real QEMU, pyroute2)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from forkd.errors import InvalidInput
from forkd.store.store import Store

pytestmark = pytest.mark.vm

ECHO_SERVER = """
import socket, threading
def _serve(srv):
    while True:
        c, _ = srv.accept()
        with c:
            c.sendall(b"pong " + socket.gethostname().encode() + b" " + c.recv(64))
_srv = socket.socket(); _srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
_srv.bind(("0.0.0.0", 7000)); _srv.listen(4)
threading.Thread(target=_serve, args=(_srv,), daemon=True).start()
"""


@pytest.fixture(scope="session")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available()
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    r = recipe.parse(text, src="tiny+network")
    assert r.network
    return build(store, r, "tiny-net:test").ref


def test_netns_children_have_own_mac_ip_and_are_reachable(
    store: Store, tiny_net: str, tiny: str, cleanup_children: None,
) -> None:
    from forkd.engine import children as ch
    from forkd.engine import netns

    kids = ch.fork(store, tiny_net, 2, with_netns=True).children
    assert len(kids) == 2
    macs, ips = set(), set()
    for k in kids:
        assert k.netns and netns.exists(k.netns) and k.mac and k.ip
        guest_mac = ch.exec_in(k.id, ["cat", "/sys/class/net/eth0/address"])["stdout"].strip()
        assert guest_mac == k.mac
        r = ch.eval_in(k.id, "import socket, fcntl, struct\n"
                             "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                             "socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, "
                             "struct.pack('256s', b'eth0'))[20:24])")
        assert r["error"] is None and r["value"] == k.ip.split("/")[0]
        macs.add(guest_mac)
        ips.add(k.ip)
        assert ch.eval_in(k.id, ECHO_SERVER)["error"] is None
        # the host reaches the guest only from inside the child's namespace
        with netns.entered(k.netns), socket.create_connection((k.ip.split("/")[0], 7000),
                                                               timeout=20) as s:
            s.sendall(b"ping")
            assert s.recv(128) == f"pong {k.id} ping".encode()
    assert len(macs) == 2 and len(ips) == 2
    # kill removes the namespace and its tap
    for k in kids:
        ch.kill(k.id)
        assert k.netns is not None and not netns.exists(k.netns)
    # a snapshot without a NIC cannot give its children a network
    with pytest.raises(InvalidInput, match="no network device"):
        ch.fork(store, tiny, 1, with_netns=True)
    # children of a NIC snapshot always get a namespace (the NIC needs its tap backend)
    auto = ch.fork(store, tiny_net, 1).children[0]
    assert auto.netns is not None and netns.exists(auto.netns)
    assert ch.eval_in(auto.id, "1+1")["value"] == 2
    ch.kill(auto.id)
    assert not netns.exists(auto.netns)


def test_children_start_while_forked_processes_hold_their_tap(
    store: Store, tiny_net: str, cleanup_children: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process forked by another thread while a namespace's tap is being made holds a
    copy of the creating descriptor until it execs. QEMU attaching the tap by name then
    failed "Device or resource busy" (one child in ten of a network fan-out); QEMU now gets
    the creating descriptor itself, so such a copy is its own queue, not a rival."""
    import subprocess

    from forkd.engine import children as ch
    from forkd.engine import netns

    holders: list[subprocess.Popen[bytes]] = []
    real_create = netns.create

    def create_with_a_stray_copy(name: str) -> None:
        real_create(name)
        fd = netns._taps[name]  # what a fork from another thread copies at this moment
        holders.append(subprocess.Popen(["sleep", "120"], pass_fds=(fd,)))

    monkeypatch.setattr(netns, "create", create_with_a_stray_copy)
    try:
        kids = ch.fork(store, tiny_net, 3, with_netns=True).children
        assert len(kids) == 3 and len(holders) == 3
        for k in kids:
            assert k.netns is not None
            assert ch.eval_in(k.id, "1+1")["value"] == 2
            up = ch.exec_in(k.id, ["cat", "/sys/class/net/eth0/operstate"])["stdout"].strip()
            assert up == "up"
            fds = Path(f"/proc/{k.pid}/fdinfo")
            assert any("iff:\ttap0" in f.read_text() for f in fds.iterdir()), \
                "QEMU holds no descriptor of tap0"
        for k in kids:
            ch.kill(k.id)
            assert k.netns is not None and not netns.exists(k.netns)
        assert not netns._taps, "a tap descriptor outlived its namespace"
    finally:
        for h in holders:
            h.kill()
            h.wait(10)


def test_a_namespace_keeps_its_tap_descriptor_until_removed() -> None:
    import secrets

    from forkd.engine import netns

    why = netns.available()
    if why:
        pytest.skip(why)
    name = f"{netns.PREFIX}taptest-{secrets.token_hex(3)}"
    netns.create(name)
    try:
        fd = netns._taps[name]
        assert "iff:\ttap0" in Path(f"/proc/self/fdinfo/{fd}").read_text()
        with netns.entered(name):  # (sysfs shows the host's namespace: ask a socket)
            assert socket.if_nametoindex("tap0") > 0
    finally:
        netns.remove(name)
    assert name not in netns._taps and not netns.exists(name)
    closed = Path(f"/proc/self/fdinfo/{fd}")  # (or the number reused by another open)
    assert not closed.exists() or "iff:\ttap0" not in closed.read_text()
    assert netns.take_tap(name) is None
