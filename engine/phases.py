"""Timed phases of an image build, for the user (progress lines) and the debug log.

Every phase of `forkd build` that can take long (debootstrap, package installs, pip, the
root disk, boot, warm-up, snapshot, storing the layer) runs inside ``phase``. When it ends
the progress callback gets ``phase NAME: S s`` and the ``forkd.build`` logger a DEBUG record
with the recipe, the phase and its seconds; bench/quickstart_build.py reads those lines.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[str], None]
log = logging.getLogger("forkd.build")
# what ``phase`` prints when a phase ends (parsed by bench/quickstart_build.py)
LINE = re.compile(r"phase (?P<name>[a-z][a-z0-9 +-]*): (?P<seconds>[0-9]+\.[0-9]) s$")


@contextmanager
def phase(name: str, recipe: str, progress: Progress) -> Iterator[None]:
    """Time the block as phase ``name`` of ``recipe``'s build (reported when it ends)."""
    t0 = time.monotonic()
    yield
    done(name, recipe, time.monotonic() - t0, progress)


def done(name: str, recipe: str, seconds: float, progress: Progress) -> None:
    """Report phase ``name`` of ``recipe``'s build as taking ``seconds``."""
    log.debug("build %s: phase %s took %.1f s", recipe, name, seconds)
    progress(f"phase {name}: {seconds:.1f} s")
