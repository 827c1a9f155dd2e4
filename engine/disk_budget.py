"""The disk all children's copy-on-write overlays may take together: ``FORKD_DISK_BUDGET``.

Each child writes into its own qcow2 overlay (``$FORKD_RUN/children/ID/disk.qcow2``) and
the overlay grows with what the guest writes, up to the whole disk's size plus its
tables; nothing else bounds it, so N children (a guest filling its disk, N times) could
fill the host's filesystem, and with it the store, the daemon's records and every other
child's writes. With ``FORKD_DISK_BUDGET`` set (bytes, or with a K, M, G or T suffix:
binary units), a child is admitted only when every overlay of the run directory could
grow to its most (``most``: its disk's size, from the qcow2 header, plus its tables, or
what it holds now if that is more) within the budget. The check and the overlay's copy
happen under one lock, so two forks cannot both take the last room. A child that would
exceed it is refused before its QEMU starts (DiskBudgetExceeded, naming the setting);
a child admitted can never run out of it, so none is stopped or corrupted later. Unset,
there is no bound (as before). The budget is per ``$FORKD_RUN``: daemons with run
directories of their own on one filesystem each have theirs.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from forkd.engine.errors import EngineError
from forkd.engine.paths import children_dir, run_dir
from forkd.engine.qcow2 import CLUSTER, MAGIC
from forkd.errors import Conflict, InvalidInput
from forkd.names import shown
from forkd.units import human_bytes

BUDGET_ENV = "FORKD_DISK_BUDGET"
DISK_FILE = "disk.qcow2"
LOCK_FILE = "disk-budget.lock"
LOCK_TIMEOUT_S = 60.0
_SIZE = re.compile(r"\A([0-9]{1,15})([KMGT]?)(?:i?B)?\Z", re.ASCII | re.IGNORECASE)
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


class DiskBudgetExceeded(EngineError, Conflict):
    """A child's overlay could not grow to its disk's size within FORKD_DISK_BUDGET."""


def configured() -> int | None:
    """The budget in bytes, None when ``FORKD_DISK_BUDGET`` is unset or empty."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return None
    found = _SIZE.match(text)
    if found is None:
        raise InvalidInput(f"{BUDGET_ENV}={shown(text)} is not a size: give bytes or a "
                           "number with K, M, G or T (binary units), e.g. 200G")
    return int(found.group(1)) << _UNITS[found.group(2).upper()]


def most(overlay: Path) -> int:
    """The most a qcow2 overlay can take on disk: its disk's size (the header's) and the
    tables that map it (an L2 table per 512 MiB, a refcount block per 2 GiB, the fixed
    clusters), or its present size if that is more."""
    with open(overlay, "rb") as f:
        head = f.read(32)
        size_now = os.fstat(f.fileno()).st_size
    if len(head) < 32 or head[:4] != MAGIC:
        raise InvalidInput(f"{overlay} is not a qcow2 image")
    virtual = int.from_bytes(head[24:32], "big")
    return max(virtual + virtual // 4096 + 16 * CLUSTER, size_now)


def _held(but: Path) -> int:
    """What the overlays of the run directory's children (running, paused, waiting in a
    pool, starting) may take, but ``but``'s."""
    total = 0
    for d in children_dir().iterdir():
        disk = d / DISK_FILE
        if d.name.startswith(".") or disk == but:
            continue
        try:
            total += most(disk)
        except (OSError, InvalidInput):
            continue  # no overlay (yet, or any more): nothing to grow
    return total


def place_overlay(template: Path, disk: Path) -> None:
    """Copy the empty overlay ``template`` to the child's ``disk``, within the budget."""
    budget = configured()
    if budget is None:
        shutil.copyfile(template, disk)
        return
    from forkd.engine.lifecycle import lock_file  # (lifecycle places overlays through this)

    busy = f"the disk budget's lock ({run_dir() / LOCK_FILE}) stayed taken; try again"
    with lock_file(run_dir() / LOCK_FILE, LOCK_TIMEOUT_S, busy):
        want = most(template)
        held = _held(disk)
        if held + want > budget:
            raise DiskBudgetExceeded(
                f"its disk may grow to {human_bytes(want)} and the children's overlays "
                f"already may take {human_bytes(held)}, over {BUDGET_ENV}="
                f"{human_bytes(budget)} (every overlay counted at its disk's full size): "
                f"kill or pause children, or raise {BUDGET_ENV}")
        shutil.copyfile(template, disk)
