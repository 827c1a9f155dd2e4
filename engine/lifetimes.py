"""Sandbox lifetimes: a deadline in each child's record, enforced by one sweeper at a time.

A child forked with a timeout has ``deadline`` (epoch seconds) and ``on_timeout`` (kill or
pause) in its child.json. ``enforce`` kills or pauses every running child whose deadline
has passed, and cleans up a crashed one (its VM ended by itself) whose deadline has. Who
calls it: the controller daemon's sweeper thread (every second, and at start, so deadlines
that passed while it was down are acted on at once), or — when no daemon runs — the
engine's watchdog (engine/watchdog.py), one small process per ``$FORKD_RUN`` started by
any fork, extend or resume that sets a deadline and exiting once no child has one. Both
take ``$FORKD_RUN/sweeper.lock`` for each sweep, so a child is acted on once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from forkd.engine import children as ch
from forkd.engine.errors import ChildNotFound, EngineError
from forkd.engine.lifecycle import (
    MAX_TIMEOUT_S,
    ChildInfo,
    check_seconds,
    child_dir,
    record_lock,
    require_running,
)
from forkd.engine.paths import run_dir
from forkd.errors import ForkdError, InvalidInput
from forkd.store.store import Store

_DURATION_RE = re.compile(r"\A(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?"
                          r"(?:(\d+(?:\.\d+)?)s?)?\Z")


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``5m``, ``1h30m``, ``2d``; InvalidInput otherwise."""
    m = _DURATION_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if m is None or not any(m.groups()):
        raise InvalidInput(f"duration {text!r}: expected e.g. 90, 90s, 5m, 1h30m or 2d")
    d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = d * 86400 + h * 3600 + mi * 60 + s
    check_seconds("duration", seconds)
    return seconds


def time_left(info: ChildInfo, now: float | None = None) -> float | None:
    """Seconds until the child's deadline (0 when passed), None without one."""
    if info.deadline is None:
        return None
    return max(0.0, info.deadline - (now or time.time()))


def extend(child_id: str, seconds: float) -> ChildInfo:
    """Move the child's deadline ``seconds`` later (from now when it had none, or when it
    has passed but the sweeper has not acted yet), and lengthen its lifetime (``timeout_s``)
    by as much: a paused child has no deadline and a resume gives it its lifetime again,
    so an extension is not lost across a pause."""
    check_seconds("extension", seconds)
    d = child_dir(child_id)
    with record_lock(d):
        info = ChildInfo.load(d)
        now = time.time()
        if info.state() == "paused":
            info.timeout_s = (info.timeout_s or 0.0) + seconds
            check_seconds("the lifetime after resume", info.timeout_s)
        else:
            require_running(info)
            info.deadline = max(info.deadline or now, now) + seconds
            check_seconds("the time left", info.deadline - now)  # extends add up: bounded too
            info.timeout_s = min((info.timeout_s or 0.0) + seconds, MAX_TIMEOUT_S)  # resumable
        info.save()
    info.status = info.state()
    return info


# a deadline binds a running child and one whose QEMU ended without `forkd kill` (a guest
# can end its own VM: reboot, panic, kill its init): the crashed one still holds its netns,
# cgroups, egress proxy (with the secrets it injects) and disk overlay until it is cleaned up
BOUND = ("running", "crashed")


def due(now: float | None = None) -> list[ChildInfo]:
    """Running or crashed children whose deadline has passed."""
    now = now or time.time()
    return [c for c in ch.list_children()
            if c.deadline is not None and c.deadline <= now and c.status in BOUND]


def next_deadline() -> float | None:
    """The earliest deadline of a running or crashed child, None when no child has one."""
    found = [c.deadline for c in ch.list_children()
             if c.deadline is not None and c.status in BOUND]
    return min(found) if found else None


@dataclass(frozen=True)
class Action:
    id: str
    action: str  # "killed", "paused", or "failed"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "detail": self.detail}


def enforce(store: Store, now: float | None = None) -> list[Action]:
    """Kill or pause every running child past its deadline (re-checked under its record
    lock, so an extend that came first wins). A pause that fails kills the child: a
    deadline is a promise that the VM stops using the host."""
    done: list[Action] = []
    for info in due(now):
        with contextlib.suppress(ChildNotFound):
            done.append(_act(store, info.id, now))
    return done


def _act(store: Store, child_id: str, now: float | None) -> Action:
    d = child_dir(child_id)
    with record_lock(d):
        info = ChildInfo.load(d)
        state = info.state()
        if (info.deadline is None or info.deadline > (now or time.time())
                or state not in BOUND):
            return Action(child_id, "skipped", "extended or ended meanwhile")
        action = info.on_timeout
    if state == "crashed":  # nothing to pause: what it left is removed
        ch.kill(child_id, store)
        return Action(child_id, "killed", "its VM had ended by itself")
    if action == "pause":
        from forkd.engine.pause import pause

        try:
            pause(store, child_id)
            return Action(child_id, "paused")
        except ForkdError as e:
            ch.kill(child_id, store)
            return Action(child_id, "killed", f"the pause failed: {e}")
    ch.kill(child_id, store)
    return Action(child_id, "killed")


@contextlib.contextmanager
def sweeper_lock(block: bool = False) -> Iterator[bool]:
    """``$FORKD_RUN/sweeper.lock``: yields whether this process holds it (one sweeper at a
    time; the holder's pid is in the file)."""
    fd = os.open(run_dir() / "sweeper.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
    finally:
        os.close(fd)


def sweep_once(store: Store) -> list[Action]:
    """One sweep, unless another sweeper is in the middle of one (then nothing)."""
    with sweeper_lock() as mine:
        if not mine:
            return []
        try:
            return enforce(store)
        except EngineError as e:
            return [Action("-", "failed", str(e))]
