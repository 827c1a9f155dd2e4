"""engine/lifecycle.py without a VM: records are checked before anything is signalled or
removed, the pid check cannot be fooled by a directory whose name extends another's, limits
and lifetimes are validated, cleanup is idempotent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.engine import cgroup as cg
from forkd.engine.lifecycle import ChildInfo, ChildVM, Lifetime, Limits
from forkd.engine.qemu import pid_alive, pid_matches
from forkd.errors import InvalidInput


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    monkeypatch.setenv("FORKD_RUN", str(run))
    return run


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A process whose command line names a file in the directory of another child,
    <run>/children/tiny-abc123-x-0a1b2c/ (its id extends 'tiny-abc123')."""
    other = tmp_path / "run" / "children" / "tiny-abc123-x-0a1b2c"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             f"{other}/qmp.sock"])
    deadline = time.monotonic() + 10
    while b"qmp.sock" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the stand-in process never started"
        time.sleep(0.01)
    try:
        yield proc.pid, other
    finally:
        proc.kill()
        proc.wait()


def _record(d: Path, **fields: object) -> None:
    d.mkdir(parents=True, mode=0o700)
    info = {"id": d.name, "ref": "tiny:x", "digest": "sha256:" + "0" * 64, "pid": 0,
            "dir": str(d), "memory": "/nonexistent", "disk_backing": "/nonexistent",
            "memory_mib": 160, "created": time.time(), **fields}
    (d / "child.json").write_text(json.dumps(info))


def test_pid_check_is_not_fooled_by_a_directory_whose_name_extends_the_childs(
    sleeper: tuple[int, Path],
) -> None:
    pid, other = sleeper
    assert pid_matches(pid, other)
    assert not pid_matches(pid, other.parent / "tiny-abc123")


def test_kill_of_a_crashed_child_never_signals_a_process_of_another_child(
    run_dir: Path, sleeper: tuple[int, Path]
) -> None:
    from forkd.engine import children as ch

    pid, _ = sleeper
    # a crashed child whose recorded pid now belongs to a process of tiny-abc123-x-0a1b2c
    _record(run_dir / "children" / "tiny-abc123", pid=pid)
    assert ch.get("tiny-abc123").state() == "crashed"
    assert ch.kill("tiny-abc123").status == "crashed"
    assert pid_alive(pid), "forkd kill signalled another child's process"
    assert not (run_dir / "children" / "tiny-abc123").exists()


@pytest.mark.skipif(os.geteuid() != 0 or cg.v1_mount("memory") is None,
                    reason="needs root and a v1 memory cgroup hierarchy")
def test_a_record_naming_a_foreign_cgroup_is_refused_and_the_cgroup_kept(run_dir: Path) -> None:
    from forkd.engine import children as ch
    from forkd.engine.errors import HostError

    mount = cg.v1_mount("memory")
    assert mount is not None
    victim = mount / f"forkd-test-victim-{os.getpid()}"
    victim.mkdir()
    try:
        _record(run_dir / "children" / "evil-000001", cgroup=str(victim))
        with pytest.raises(HostError, match="not a forkd cgroup"):
            ch.kill("evil-000001")
        assert victim.is_dir()
    finally:
        victim.rmdir()


def test_a_record_naming_a_foreign_netns_is_refused(run_dir: Path) -> None:
    from forkd.engine import children as ch
    from forkd.engine.errors import HostError

    _record(run_dir / "children" / "evil-000002", netns="host-ns")
    with pytest.raises(HostError, match="network namespace"):
        ch.kill("evil-000002")


def test_a_record_for_another_directory_is_not_a_child(run_dir: Path) -> None:
    from forkd.engine import children as ch
    from forkd.engine.errors import HostError

    d = run_dir / "children" / "copy-000003"
    _record(d)
    raw = json.loads((d / "child.json").read_text())
    raw["dir"] = "/somewhere/else"
    (d / "child.json").write_text(json.dumps(raw))
    with pytest.raises(HostError, match="not a valid child record"):
        ChildInfo.load(d)
    assert ch.list_children() == []
    with pytest.raises(HostError, match="by hand"):
        ch.kill("copy-000003")  # nothing signalled or removed on the word of a bad record
    assert d.is_dir()
    (d / "child.json").write_text("{not json")
    with pytest.raises(HostError, match="not a valid child record"):
        ch.kill("copy-000003")


def test_cleanup_is_idempotent_and_removes_the_directory(run_dir: Path) -> None:
    d = run_dir / "children" / "gone-000004"
    _record(d)
    child = ChildVM.adopt(d)
    child.cleanup()
    child.cleanup()
    assert not d.exists()


@pytest.mark.parametrize("limits", [
    Limits(memory_mib=10), Limits(cpus=0), Limits(cpus=float("nan")), Limits(cpus=True),
    Limits(pids=3), Limits(disk_bps=1), Limits(disk_iops=0), Limits(net_kbit=1),
    Limits(pids=2.5),  # type: ignore[arg-type]
])
def test_out_of_range_limits_are_refused(limits: Limits) -> None:
    with pytest.raises(InvalidInput):
        limits.checked()


@pytest.mark.parametrize("lifetime", [
    Lifetime(0), Lifetime(-5), Lifetime(float("inf")), Lifetime(31 * 86400),
    Lifetime(60, "explode"),
])
def test_out_of_range_lifetimes_are_refused(lifetime: Lifetime) -> None:
    with pytest.raises(InvalidInput):
        lifetime.checked()


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("5m", 300), ("1h30m", 5400), ("2d", 172800), (" 1.5m ", 90),
])
def test_durations(text: str, seconds: float) -> None:
    from forkd.engine.lifetimes import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "5x", "-5", "1m1h", "0", "31d", "1e9", "5 m"])
def test_bad_durations_are_refused(text: str) -> None:
    from forkd.engine.lifetimes import parse_duration

    with pytest.raises(InvalidInput):
        parse_duration(text)


@pytest.mark.skipif(os.geteuid() != 0 or cg.v1_mount("pids") is None,
                    reason="needs root and a v1 pids cgroup hierarchy")
def test_a_cgroup_that_cannot_be_removed_keeps_the_record_for_a_second_kill(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill must not forget a child whose cgroup is still busy (an OOM-killed QEMU's memory
    can hold it for a while): the record stays, and a later kill removes everything."""
    from forkd.engine import children as ch
    from forkd.engine.errors import HostError

    monkeypatch.setattr(cg, "REMOVE_TIMEOUT_S", 0.5)
    mount = cg.v1_mount("pids")
    assert mount is not None
    (mount / "forkd").mkdir(exist_ok=True)
    group = mount / "forkd" / "busy-000005"
    group.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (group / "cgroup.procs").write_text(str(holder.pid))
        d = run_dir / "children" / "busy-000005"
        _record(d, cgroup=str(group), cgroups={"pids": str(group)})
        with pytest.raises(HostError, match="again"):
            ch.kill("busy-000005")
        assert (d / "child.json").exists() and group.is_dir()
    finally:
        holder.kill()
        holder.wait()
    ch.kill("busy-000005")
    assert not d.exists() and not group.exists()


def test_extensions_add_up_to_at_most_the_longest_lifetime(run_dir: Path) -> None:
    """Each extend is bounded, and so is their sum: a deadline is never more than 30 days
    away (here on a paused record: its lifetime after the resume)."""
    from forkd.engine.lifetimes import extend

    _record(run_dir / "children" / "slept-000006", paused_tag="forkd-paused/slept-000006:a",
            timeout_s=29 * 86400.0)
    assert extend("slept-000006", 3600).timeout_s == 29 * 86400.0 + 3600
    with pytest.raises(InvalidInput, match="30 days"):
        extend("slept-000006", 2 * 86400)
    assert ChildInfo.load(run_dir / "children" / "slept-000006").timeout_s == 29 * 86400 + 3600
