"""Where the engine keeps things on the host (one owner of the layout).

```
$FORKD_CACHE (default ~/.cache/forkd)      build inputs, safe to delete
  debs/<pkg>_<ver>.deb                      apt-get download results
  kernel/<deb sha256[:16]>/vmlinux|modules/ extracted guest kernel
  rootfs/<key>/root/ + ok                   debootstrap trees (key = suite+packages)
  images/<key>/root.raw, initrd.img         root disk and initramfs per recipe content
  builds/<recipe digest>.json               build cache: recipe content -> tag/digest, the
                                            last build of any store (each store keeps its own)
$FORKD_RUN (default /run/forkd, else $XDG_RUNTIME_DIR/forkd)
  children/<id>/                            one per child VM (lifecycle.py owns it)
     child.json qmp.sock agent.sock qemu.log disk.qcow2 lock record.lock
  watchdog.lock watchdog.log sweeper.lock   the deadline watchdog and sweeps (lifetimes.py)
  work/                                     temporary template/branch work dirs
```
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from forkd.private import private_dir

# The longest AF_UNIX address (sun_path is 108 bytes with its NUL).
SUN_PATH_MAX = 107


def fits_sun_path(path: Path | str) -> bool:
    return len(os.fsencode(str(path))) <= SUN_PATH_MAX


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """``path`` as an AF_UNIX address to bind or connect to while the block runs: itself
    when it fits sun_path, else the same file named through /proc/self/fd of its
    directory (opened O_PATH for the block), which is as short whatever the directory.
    A child's sockets are under $FORKD_RUN/children/<id>/: a long run directory with a
    longer id put them past 108 bytes ('AF_UNIX path too long'), and so the ids were
    kept short, 24 random bits that came round among a long-running host's ids."""
    if fits_sun_path(path):
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def cache_path() -> Path:
    """Where $FORKD_CACHE is, made or not (``cache_dir`` makes it)."""
    env = os.environ.get("FORKD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "forkd"


def cache_dir() -> Path:
    base = cache_path()
    base.mkdir(parents=True, exist_ok=True)
    return base


def _run_location() -> tuple[Path, int]:
    """$FORKD_RUN and how many of its last levels forkd owns (``private_dir``)."""
    env = os.environ.get("FORKD_RUN")
    if env:
        return Path(env), 1
    if os.geteuid() == 0:
        return Path("/run/forkd"), 1
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "forkd", 1
    return Path(f"/tmp/forkd-{os.geteuid()}") / "forkd", 2


def run_path() -> Path:
    """Where $FORKD_RUN is (absolute), made or checked or not (``run_dir`` does both)."""
    return Path(os.path.abspath(_run_location()[0]))


def run_dir() -> Path:
    """$FORKD_RUN, made or checked as a private directory (forkd.private) on every call."""
    path, owned_levels = _run_location()
    return private_dir(path, owned_levels=owned_levels)


def children_dir() -> Path:
    d = run_dir() / "children"
    d.mkdir(parents=True, exist_ok=True)
    return d


def work_dir() -> Path:
    d = run_dir() / "work"
    d.mkdir(parents=True, exist_ok=True)
    return d


def hidden_host_paths(text: str, home: Path | None = None) -> str:
    """``text`` (an error an API answers with) with this host's forkd directories named by
    their variables: ``$FORKD_HOME`` (the store ``home``, default the user's),
    ``$FORKD_RUN``, ``$FORKD_CACHE``. A remote caller learns what went wrong, not where
    this host keeps its stores, sandboxes and caches; the daemon's log keeps the paths.
    It only derives the paths (an error path makes no directory and cannot fail a check)."""
    from forkd.store.store import default_home

    places = [(str(home or default_home()), "$FORKD_HOME"), (str(run_path()), "$FORKD_RUN"),
              (str(cache_path()), "$FORKD_CACHE")]
    for path, name in sorted(places, key=lambda p: -len(p[0])):  # the longest first
        if len(path) > 1:
            text = text.replace(path, name)
    return text
