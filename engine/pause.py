"""Pause a child into the store and resume it under the same id.

pause: a branch (engine/branch.py) of the running child into a tag private to it,
``forkd-paused/<id>:a`` or ``:b`` (the two alternate: a layer cannot be its own parent),
then its QEMU, cgroups, netns and files are freed; only the record stays, with
``paused_tag``. resume: a fork of that tag into the same directory, id, limits, sandbox
and network identity (the MAC and IP come from the id); the memory, device state and disk
are the ones saved, so files and running processes are as they were (the agent's fixup
sets the clock and mixes in fresh entropy, as for every child).
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path

from forkd.engine import children as ch
from forkd.engine.branch import branch
from forkd.engine.egress.child import EgressSettings
from forkd.engine.errors import EngineError
from forkd.engine.lifecycle import (
    CHILD_FILE,
    ChildInfo,
    ChildVM,
    Lifetime,
    child_dir,
    private_tags,
    record_lock,
    require_running,
)
from forkd.engine.paths import children_dir
from forkd.engine.qemu import create_overlay
from forkd.errors import Conflict
from forkd.store.store import Store


def pause(store: Store, child_id: str) -> ChildInfo:
    """Save the running child as a diff layer under its private tag and free its VM."""
    d = child_dir(child_id)
    with record_lock(d):
        info = ChildInfo.load(d)
        require_running(info)
        first, second = private_tags(child_id)
        tag = second if info.ref == first else first
        t0 = time.monotonic()
        result = branch(store, child_id, tag, force=True)
        t_saved = time.monotonic()
        child = ChildVM.adopt(d)
        child.release()
        info = child.info
        info.paused_tag = tag
        info.ref, info.digest = tag, result.digest
        info.pid = 0
        info.deadline = None  # a paused child costs nothing; resume starts its lifetime again
        info.cgroup = None
        info.cgroups = {}
        info.timings_ms = {"save": round((t_saved - t0) * 1000, 1),
                           "pause": round(result.pause_ms, 1),
                           "freed": round((time.monotonic() - t0) * 1000, 1)}
        info.save()
        info.status = "paused"
        return info


def resume(store: Store, child_id: str) -> ChildInfo:
    """Bring a paused child back under the same id: its saved memory, processes and disk."""
    d = child_dir(child_id)
    with record_lock(d):
        saved = (d / CHILD_FILE).read_text()
        old = ChildInfo.load(d)
        if old.state() != "paused" or old.paused_tag is None:
            raise Conflict(f"child {child_id} is {old.state()}, not paused; only a paused "
                           "child can be resumed")
        limits = old.limits_obj()
        asm, with_netns = ch.prepare(store, old.paused_tag, limits=limits,
                                     with_netns=old.netns is not None)
        assert asm.disk is not None
        tpl = children_dir() / f".overlay-{secrets.token_hex(4)}"
        tpl.mkdir()
        try:
            overlay = tpl / "empty.qcow2"
            create_overlay(overlay, asm.disk, "raw")
            w = ch.launch_waiting(asm, old.paused_tag, child_id, overlay, limits, old.sandbox,
                                  with_netns, resuming=True)
            egress = EgressSettings.from_record(old.egress) if old.egress else None
            info = ch.become_child(w, Lifetime(old.timeout_s, old.on_timeout), egress)
        except BaseException:
            _put_back(d, saved)
            raise
        finally:
            shutil.rmtree(tpl, ignore_errors=True)
        info.origin, info.created = old.origin, old.created
        info.save()
        return info


def _put_back(d: Path, record: str) -> None:
    """A failed resume removed the directory: the child is paused again, as it was."""
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        tmp = d / (CHILD_FILE + ".tmp")
        tmp.write_text(record)
        tmp.replace(d / CHILD_FILE)
    except OSError as e:
        raise EngineError(f"child {d.name}: the resume failed and its paused record could "
                          f"not be put back: {e}") from e
