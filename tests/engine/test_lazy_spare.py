"""The spare lazy server (engine/lazy/spare.py): one waits per run directory, loaded; the
first taker gets it (later ones find none), it serves the directory the taker names in
the taker's working directory, logging there; ended or hung up on, it leaves no process,
no socket and no log. The daemon's keeper (SpareKeeper) keeps one waiting and ends it when
it stops, unless it was taken."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.engine.lazy import spare
from forkd.engine.lazy.spare import (
    PID,
    SOCKET,
    SpareKeeper,
    Taken,
    end_spare,
    ensure_spare,
    spare_dir,
    spares_of,
)
from forkd.engine.qemu import pid_alive

WAIT = 120.0  # seconds for a spare to load on a loaded host


def _until(what: str, ok: object) -> None:
    deadline = time.monotonic() + WAIT
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    yield spare_dir()
    end_spare()
    _until("a spare was left running", lambda: spares_of(tmp_path / "run") == [])


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _waiting(d: Path) -> int:
    _until("no spare came up", lambda: (d / SOCKET).exists() and (d / PID).exists())
    return int((d / PID).read_text())


def test_one_spare_waits_and_the_first_taker_gets_it(run_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert Taken.take() is None
    ensure_spare()
    ensure_spare()  # while the first loads: this one exits at the lock
    pid = _waiting(run_dir)
    if os.geteuid() == 0:  # it loaded at a low priority; waiting, it is back at its own
        assert _nice(pid) == os.getpriority(os.PRIO_PROCESS, 0)
    taken = Taken.take()
    assert taken is not None and taken.pid == pid
    assert Taken.take() is None, "a second taker got the same spare"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snap").mkdir()
    proc = taken.go(Path("snap"))  # relative: resolved in the taker's directory
    _until("the taken spare did not end", lambda: proc.poll() is not None)
    said = (tmp_path / "snap" / "server.log").read_text()
    assert "server.json" in said, said  # no spec there: it fails, and says so in its log
    assert not taken.log.exists()
    assert not (run_dir / SOCKET).exists()
    assert spares_of(run_dir.parent) == [], "a second spare was left waiting"


def test_a_taker_that_hangs_up_ends_the_spare(run_dir: Path) -> None:
    ensure_spare()
    pid = _waiting(run_dir)
    taken = Taken.take()
    assert taken is not None
    taken.cancel()
    _until("the spare outlived its taker", lambda: not pid_alive(pid))
    assert not taken.log.exists()


def test_end_spare_ends_the_waiting_one(run_dir: Path) -> None:
    ensure_spare()
    pid = _waiting(run_dir)
    assert end_spare()
    _until("the ended spare is still running", lambda: not pid_alive(pid))
    assert not (run_dir / SOCKET).exists() and not (run_dir / PID).exists()
    assert not end_spare()


def test_a_killed_spare_is_replaced(run_dir: Path) -> None:
    """A spare killed outright leaves its socket: a taker finds nobody there (and starts
    its own server), and the next ensure_spare starts a new spare all the same."""
    import signal

    ensure_spare()
    pid = _waiting(run_dir)
    os.kill(pid, signal.SIGKILL)
    _until("the killed spare is still running", lambda: not pid_alive(pid))
    assert (run_dir / SOCKET).exists()  # nobody cleaned up
    assert Taken.take() is None
    ensure_spare()
    _until("no new spare came up", lambda: (run_dir / PID).exists()
           and int((run_dir / PID).read_text()) != pid)


@pytest.mark.parametrize("line", [b"not json\n", b'{"dir": 3}\n', b'["dir"]\n',
                                  b'{"dir": "x", "env": "PATH=/", "cwd": "/"}\n'],
                         ids=["not-json", "dir-not-text", "not-an-object", "env-not-object"])
def test_a_spare_refuses_what_is_not_a_request(run_dir: Path, line: bytes) -> None:
    """A line that is not {"dir", "env", "cwd"} of the right types serves nothing: the
    spare ends, leaving no log."""
    ensure_spare()
    pid = _waiting(run_dir)
    taken = Taken.take()
    assert taken is not None
    with contextlib.suppress(OSError):
        taken.conn.sendall(line)
    taken.conn.close()
    _until("the spare served a bad request", lambda: not pid_alive(pid))
    assert not taken.log.exists()


def _waiting_other(d: Path, but: int) -> int:
    def other() -> bool:
        with contextlib.suppress(OSError, ValueError):
            return (d / SOCKET).exists() and int((d / PID).read_text()) != but
        return False

    _until("no other spare came up", other)
    return int((d / PID).read_text())


def test_the_keeper_keeps_one_waiting_and_ends_it_when_it_stops(run_dir: Path) -> None:
    keeper = SpareKeeper(every=0.1).start()
    try:
        first = _waiting(run_dir)
        assert end_spare()  # gone (used up, idle for too long): the keeper starts another
        _until("the ended spare is still running", lambda: not pid_alive(first))
        second = _waiting_other(run_dir, first)
    finally:
        keeper.stop()
    _until("the keeper's spare outlived the keeper", lambda: not pid_alive(second))
    assert spares_of(run_dir.parent) == []
    assert not list(run_dir.glob("spare-*.log")), "an ended spare left its log"


def test_a_spare_taken_from_the_keeper_outlives_it(run_dir: Path) -> None:
    keeper = SpareKeeper(every=0.1).start()
    try:
        pid = _waiting(run_dir)
        taken = Taken.take()
        assert taken is not None and taken.pid == pid
    finally:
        keeper.stop()  # an untaken spare of its thread gets SIGTERM now; this one must not
    time.sleep(0.5)
    assert pid_alive(pid), "the keeper's end took down a spare a taker holds"
    taken.cancel()
    _until("the spare outlived its taker", lambda: not pid_alive(pid))
    _until("a spare was left running", lambda: spares_of(run_dir.parent) == [])


def test_the_keeper_starts_nothing_where_lazy_servers_cannot_run(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spare, "lazy_supported", lambda: False)
    keeper = SpareKeeper(every=0.05).start()
    time.sleep(0.5)
    keeper.stop()
    assert spares_of(run_dir.parent) == [] and not (run_dir / PID).exists()
