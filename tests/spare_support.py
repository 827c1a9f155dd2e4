"""Ending the spare lazy servers a test's lazy forks left (engine/lazy/spare.py: each lazy
fork leaves one for the next), and checking none is left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def end_spares(run: Path, timeout: float = 30.0) -> list[int]:
    """End every spare started for run directory ``run`` (waiting, still loading, or
    taken and serving); the pids still running after ``timeout`` seconds."""
    from forkd.engine.lazy.spare import spares_of

    deadline = time.monotonic() + timeout
    while spares_of(run) and time.monotonic() < deadline:
        for pid in spares_of(run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)
    return spares_of(run)
