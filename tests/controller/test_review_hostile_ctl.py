"""The controller against the second hostile review: what its error paths, branches and
streams may do to the host. No VM unless marked."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
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


# -- what slow readers of streams make the daemon hold -----------------------------------

MIB = 1 << 20
CHUNK = bytes(MIB)  # one object put again and again: counted each time, held once


def _wait_until_still(counter: list[int], seconds: float = 0.5) -> int:
    """The counter once it stopped moving (the producers wait for their readers)."""
    last = -1
    while counter[0] != last:
        last = counter[0]
        time.sleep(seconds)
    return last


def _endless(counter: list[int]) -> object:
    def work(items: object) -> None:
        while items.put(CHUNK):  # type: ignore[attr-defined]
            counter[0] += 1

    return work


def test_a_slow_reader_makes_the_daemon_hold_a_few_mib_per_stream_and_a_bound_in_all() -> None:
    """A stream's items (a file's chunks, a command's frames) wait for its reader in the
    daemon; they were bounded by count only (64 + 16 of up to 2 MiB, 16 + 4 of 1 MiB),
    and a stream outlives the request limits (its command ended, its reader reads
    nothing): many such streams held without bound. Now bytes: a few MiB per stream,
    all but each stream's first waiting item within STREAM_BYTES (so a new stream still
    gets its output while slow readers hold the rest), and all of it is free again once
    the readers leave."""
    from forkd.controller import backend

    one = [0]
    stream = backend.produced("test-slow", _endless(one), 64)  # type: ignore[arg-type]
    assert next(stream) is CHUNK  # the reader takes one, then nothing
    waiting = _wait_until_still(one) - 1
    assert waiting * MIB <= 4 * MIB, f"{waiting} MiB wait for one reader"

    counters = [[0] for _ in range(80)]
    streams = [backend.produced(f"test-slow-{i}", _endless(c), 64)  # type: ignore[arg-type]
               for i, c in enumerate(counters)]
    try:
        for s in streams:  # each gets its first item, however many wait elsewhere
            assert next(s) is CHUNK
        # First until each stream has its next item ready (80 producer threads on a loaded
        # machine: one not run for the half second the stillness check waits made the
        # count short), then until nothing moves.
        deadline = time.monotonic() + 60
        while sum(c[0] for c in counters) - len(streams) + (one[0] - 1) < len(streams):
            assert time.monotonic() < deadline, [c[0] for c in counters]
            time.sleep(0.05)
        total = [0]
        while True:
            before = sum(c[0] for c in counters)
            time.sleep(0.5)
            total[0] = sum(c[0] for c in counters)
            if total[0] == before:
                break
        waiting = total[0] - len(streams) + (one[0] - 1)
        # 64 MiB of the process's budget, and one item per stream outside it
        assert waiting * MIB <= 64 * MIB + len(streams) * MIB, f"{waiting} MiB in all"
        assert len(streams) <= waiting < 2 * len(streams)  # each has its next item ready
        assert backend.STREAM_BUDGET.used <= backend.STREAM_BYTES
    finally:
        stream.close()
        for s in streams:
            s.close()
    deadline = time.monotonic() + 10
    while backend.STREAM_BUDGET.used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.STREAM_BUDGET.used == 0  # nothing of the readers that left is counted


class _Transfer(Iterator[bytes]):
    """``items`` as a backend.Transfer (what app.relayed takes): close closes a generator,
    abandon is told nothing here (these items never keep a reader waiting)."""

    def __init__(self, items: Iterator[bytes]) -> None:
        self._items = items

    def __next__(self) -> bytes:
        return next(self._items)

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()

    def abandon(self) -> None:
        pass


def test_the_relay_to_a_slow_client_holds_a_few_mib_and_frees_them() -> None:
    """app.relayed, the queue between the backend and the HTTP answer, is bounded by bytes
    the same way (its 16 frames of up to 2 MiB were 32 MiB per stream)."""
    import asyncio

    from forkd.controller import app

    held = app.RELAY_BUDGET.used  # an earlier test's relay still winding down, if any
    pulled = [0]

    def items() -> Iterator[bytes]:
        while True:
            pulled[0] += 1
            yield CHUNK

    async def slow_client() -> int:
        relay = app.relayed(_Transfer(items()), None, 16)
        assert await relay.__anext__() is CHUNK
        while True:  # the client takes nothing more
            before = pulled[0]
            await asyncio.sleep(0.5)
            if pulled[0] == before:
                break
        await relay.aclose()
        return pulled[0]

    got = asyncio.run(slow_client())
    assert (got - 1) * MIB <= 4 * MIB, f"{got - 1} MiB wait for one client"
    deadline = time.monotonic() + 10
    while app.RELAY_BUDGET.used > held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.RELAY_BUDGET.used == held


def test_a_relay_read_to_its_end_gives_each_items_bytes_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer put each item and then read whether the reader had left as two steps
    of the event loop (wait_for ran the put in a task of its own): a reader that took the
    last item in between had set ``gone``, so the producer gave that item's bytes back a
    second time, an IndexError in its thread at the end of every stream read whole."""
    import asyncio

    from forkd.controller import app

    held = app.RELAY_BUDGET.used  # an earlier test's relay still winding down, if any
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: failures.append(a.exc_value))

    async def read_all(n: int) -> list[object]:
        return [x async for x in app.relayed(_Transfer(iter([CHUNK] * n)), None, 4)]

    async def many() -> None:
        for i in range(200):
            assert len(await read_all(i % 4)) == i % 4
        await asyncio.sleep(0.3)  # the last producer's end

    asyncio.run(many())
    assert failures == []
    assert app.RELAY_BUDGET.used == held
