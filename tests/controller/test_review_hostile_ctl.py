"""The controller against the second hostile review: what its error paths, branches and
streams may do to the host. No VM unless marked."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from forkd.engine import paths
from forkd.engine.errors import ChildDead
from forkd.engine.qemu import pid_alive
from forkd.errors import ForkdError


def test_hiding_host_paths_in_an_error_makes_and_checks_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error answer names $FORKD_RUN and $FORKD_CACHE by their variables; deriving them
    must not create them (an error path with side effects), nor fail when the run
    directory is one ``run_dir`` would refuse (the answer would become a crash)."""
    run, cache = tmp_path / "run" / "forkd", tmp_path / "cache"
    monkeypatch.setenv("FORKD_RUN", str(run))
    monkeypatch.setenv("FORKD_CACHE", str(cache))
    text = f"cannot open {run}/children/x/qmp.sock or {cache}/images/k/root.raw"
    hidden = paths.hidden_host_paths(text, home=tmp_path / "home")
    assert hidden == "cannot open $FORKD_RUN/children/x/qmp.sock or $FORKD_CACHE/images/k/root.raw"
    assert not run.exists() and not cache.exists()
    run.mkdir(parents=True)
    os.chmod(run, 0o777)  # another user could plant files in it: run_dir refuses it
    with pytest.raises(Exception, match="writable"):
        paths.run_dir()
    assert paths.hidden_host_paths(f"{run}/x", home=tmp_path / "home") == "$FORKD_RUN/x"


# -- a kill during a branch ---------------------------------------------------------------

TINY_TAG = "tiny:review-ctl"
TOKEN = "review-ctl-token-0123456789-0123456789-0123456789"


def _branch_holds_the_lock(info: object) -> bool:
    """The exclusive side of the child's request lock is taken (a branch is copying)."""
    fd = os.open(Path(info.path) / "lock", os.O_RDWR | os.O_CREAT, 0o600)  # type: ignore[attr-defined]
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.vm
def test_a_kill_lets_a_branch_in_flight_finish(env: dict[str, str], tiny: str) -> None:
    """A kill that cut a branch's copy short left a failed branch whose message said the
    child's state was intact; the kill now waits (up to KILL_WAITS_FOR_BRANCH) for it."""
    from forkd.engine import children as ch
    from forkd.store.store import Store

    child = ch.fork(Store.open(), tiny, 1).children[0]
    info = ch.get(child.id)
    done: list[str] = []
    killer = threading.Thread(target=lambda: done.append(ch.kill(child.id).status))
    try:
        with ch.locked(info):  # what a branch holds while it copies
            killer.start()
            killer.join(1.5)
            assert killer.is_alive() and done == []  # it waits for the branch
            assert pid_alive(info.pid)
        killer.join(60)
        assert done == ["killed"]
    finally:
        killer.join(60)
        for left in ch.list_children():
            ch.kill(left.id)
    assert ch.list_children() == []


@pytest.mark.vm
def test_a_branch_whose_child_is_killed_says_so(
    env: dict[str, str], tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch stuck past the kill's wait (here: its QEMU stopped by a signal) is cut
    short; its error says the child ended and nothing was stored, not that it is intact."""
    from forkd.engine import children as ch
    from forkd.engine.branch import branch
    from forkd.store.store import Store

    monkeypatch.setattr(ch, "KILL_WAITS_FOR_BRANCH", 0.5, raising=False)
    store = Store.open()
    child = ch.fork(store, tiny, 1).children[0]
    info = ch.get(child.id)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            branch(store, child.id, "tiny:cut")
        except BaseException as e:  # the test reads it
            failed.append(e)

    brancher = threading.Thread(target=run)
    try:
        os.kill(info.pid, signal.SIGSTOP)  # its QMP answers nothing: the branch waits
        brancher.start()
        deadline = time.monotonic() + 30
        while not _branch_holds_the_lock(info):
            assert time.monotonic() < deadline and brancher.is_alive(), failed
            time.sleep(0.001)
        assert ch.kill(child.id).status == "killed"
        brancher.join(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGCONT)
        brancher.join(60)
        for left in ch.list_children():
            ch.kill(left.id)
    assert len(failed) == 1 and isinstance(failed[0], ChildDead), failed
    assert f"child {child.id} ended during the branch" in str(failed[0])
    assert "intact" not in str(failed[0]).split("said:")[0]
    with pytest.raises(ForkdError):
        store.resolve("tiny:cut")
    assert ch.list_children() == []
