"""Sandbox lifetimes and pause/resume with real VMs of the tiny recipe (no daemon: the
engine's watchdog enforces deadlines)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from msgspec import to_builtins as plain

from forkd.controller.api import ExtendRequest, SpawnRequest
from forkd.controller.backend import LocalBackend
from forkd.engine import children as ch
from forkd.engine import watchdog
from forkd.engine.lifecycle import Limits, private_tags
from forkd.engine.pause import pause, resume
from forkd.errors import Conflict
from forkd.store.store import Store

pytestmark = pytest.mark.vm

COUNTER = """
import signal, time
n = 0
def dump(*_):
    with open('/tmp/count', 'w') as f:
        f.write(str(n))
signal.signal(signal.SIGUSR1, dump)
open('/tmp/counter.ready', 'w').close()
while True:
    n += 1
    time.sleep(0.01)
"""


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _gone(child_id: str) -> bool:
    return child_id not in {c.id for c in ch.list_children()}


def _count(child_id: str) -> tuple[int, int]:
    """(pid, in-memory count) of the guest's counter process."""
    r = ch.exec_in(child_id, ["sh", "-c", "p=$(cat /tmp/counter.pid); rm -f /tmp/count; "
                              "kill -USR1 $p; while [ ! -s /tmp/count ]; do sleep 0.05; done; "
                              "echo $p $(cat /tmp/count)"], timeout=60)
    assert r["exit_code"] == 0, r
    pid, count = r["stdout"].split()
    return int(pid), int(count)


def test_deadline_kills_without_a_daemon_and_extend_moves_it(
    store: Store, tiny: str, cleanup_children: None, engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    backend = LocalBackend(store)  # in-process: the watchdog enforces
    short = plain(backend.spawn(SpawnRequest(tag=tiny, timeout=3)))["sandboxes"][0]
    kept = plain(backend.spawn(SpawnRequest(tag=tiny, timeout=3)))["sandboxes"][0]
    assert 0 < short["time_left_s"] <= 3 and short["on_timeout"] == "kill"
    extended = plain(backend.extend(kept["id"], ExtendRequest(seconds=120)))
    assert extended["time_left_s"] > 100
    assert extended["timeout_s"] == 123  # the lifetime a resume would give again
    # Started detached by the spawn, it holds its lock once its interpreter has started
    # and imported the engine (was asserted at once: a loaded machine is not there yet).
    _until("the watchdog to run", lambda: watchdog.running_pid() is not None, 60)
    # Its directory goes last (after QEMU, cgroups, netns), and not at once (rmtree: its
    # record may be gone while the rest is not yet): wait for that, not for the listing.
    short_dir = engine_env["FORKD_RUN"] / "children" / short["id"]
    _until("the short-lived child to be killed", lambda: not short_dir.exists(), 60)
    assert _gone(short["id"])
    assert short["pid"] not in qemu_pids(engine_env["FORKD_RUN"])
    info = plain(backend.sandbox(kept["id"]))
    assert info["status"] == "running" and info["time_left_s"] > 90
    ch.kill(kept["id"])
    _until("the idle watchdog to exit", lambda: watchdog.running_pid() is None,
           watchdog.IDLE_EXIT_S + 30)


def test_deadline_pauses_when_asked_and_resume_gives_the_lifetime_again(
    store: Store, tiny: str, cleanup_children: None,
) -> None:
    backend = LocalBackend(store)
    sb = plain(backend.spawn(SpawnRequest(tag=tiny, timeout=3, on_timeout="pause")))["sandboxes"][0]
    ch.exec_in(sb["id"], ["sh", "-c", "echo kept > /root/f && sync"])
    _until("the child to be paused", lambda: backend.sandbox(sb["id"]).status == "paused", 90)
    paused = plain(backend.sandbox(sb["id"]))
    assert paused["time_left_s"] is None and paused["pid"] == 0
    back = plain(backend.resume(sb["id"]))
    assert back["status"] == "running" and 0 < back["time_left_s"] <= 3
    backend.extend(sb["id"], ExtendRequest(seconds=300))
    assert ch.exec_in(sb["id"], ["cat", "/root/f"])["stdout"] == "kept\n"
    ch.kill(sb["id"])
    _until("the idle watchdog to exit", lambda: watchdog.running_pid() is None,
           watchdog.IDLE_EXIT_S + 30)


def test_five_pause_resume_cycles_keep_files_and_a_running_process(
    store: Store, tiny: str, cleanup_children: None, engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
) -> None:
    # a cgroup limit that never bites, to see the cgroup freed and made again
    child = ch.fork(store, tiny, 1, limits=Limits(pids=4096)).children[0]
    cid = child.id
    with ch.agent(cid) as a:
        a.put("/tmp/counter.py", COUNTER.encode())
    r = ch.exec_in(cid, ["sh", "-c", "python3 /tmp/counter.py </dev/null >/dev/null 2>&1 & "
                         "echo $! > /tmp/counter.pid; "
                         "while [ ! -e /tmp/counter.ready ]; do sleep 0.05; done"], timeout=120)
    assert r["exit_code"] == 0
    pid, last = _count(cid)
    seen: list[int] = [last]
    for cycle in range(5):
        ch.exec_in(cid, ["sh", "-c", f"echo cycle{cycle} > /root/file{cycle} && sync"])
        info = pause(store, cid)
        assert info.state() == "paused" and info.paused_tag in private_tags(cid)
        assert qemu_pids(engine_env["FORKD_RUN"]) == [] or all(
            str(info.path) + "/" not in Path(f"/proc/{p}/cmdline").read_text()
            for p in qemu_pids(engine_env["FORKD_RUN"]))
        assert not Path(child.cgroup or "/nonexistent").exists()
        assert sorted(p.name for p in info.path.iterdir()) <= ["child.json", "lock",
                                                               "record.lock"]
        resume(store, cid)
        with pytest.raises(Conflict):
            resume(store, cid)  # running again: only a paused child resumes
        again = ch.get(cid)
        assert again.state() == "running" and again.id == cid
        assert again.cgroup and Path(again.cgroup).is_dir()
        got_pid, count = _count(cid)
        assert got_pid == pid, "the counter process was restarted"
        assert count > seen[-1], f"cycle {cycle}: count {count} after {seen[-1]}"
        seen.append(count)
        files = ch.exec_in(cid, ["sh", "-c", "cat /root/file*"])["stdout"].split()
        assert files == [f"cycle{i}" for i in range(cycle + 1)]
    tags = set(private_tags(cid))
    ch.kill(cid)
    assert not tags & {i.ref for i in store.images()}
    assert [p.name for p in (engine_env["FORKD_RUN"] / "children").iterdir()] == []


@pytest.fixture(scope="module")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available()
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    return build(store, recipe.parse(text, src="tiny+network"), "tiny-net:life").ref


def test_resume_keeps_network_identity_and_limits(
    store: Store, tiny_net: str, cleanup_children: None
) -> None:
    import subprocess

    from forkd.engine import netns

    child = ch.fork(store, tiny_net, 1, limits=Limits(cpus=1.5, net_kbit=4000)).children[0]
    ch.exec_in(child.id, ["sh", "-c", "echo net > /root/n && sync"])
    paused = pause(store, child.id)
    assert paused.netns is not None and not netns.exists(paused.netns)
    back = resume(store, child.id)
    assert (back.netns, back.mac, back.ip) == (child.netns, child.mac, child.ip)
    assert back.limits == {"cpus": 1.5, "net_kbit": 4000}
    assert back.cgroups and Path(back.cgroups["cpu"], "cpu.cfs_quota_us").read_text().strip() \
        == "150000"
    mac = ch.exec_in(back.id, ["cat", "/sys/class/net/eth0/address"])["stdout"].strip()
    assert mac == child.mac
    assert ch.exec_in(back.id, ["cat", "/root/n"])["stdout"] == "net\n"
    assert back.netns is not None
    with netns.entered(back.netns):
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", "tap0"], capture_output=True,
                                text=True, check=True).stdout
    assert "tbf" in qdiscs
    ch.kill(back.id)
    assert not netns.exists(back.netns)
