"""Directories and files only this user may touch: the run directory and the secrets in it.

A **private directory** level is a real directory (not a symlink) owned by the effective
uid and not writable by group or others. ``private_dir`` creates every level forkd owns
with mode 0700 and refuses a level that fails the check, so another local user cannot
pre-create it (e.g. ``/tmp/forkd-UID``) and plant files in it. The directories above
the owned levels, as written and as resolved, must be owned by root or this user, and
be writable by group/others only when sticky (like ``/tmp``), so nobody else can swap
an owned level after the check.

A **private file** is a regular file (not a symlink) owned by this user with no group or
other permission bits. ``create_private_file`` writes it whole under a temporary name
(``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600) and links it into place, so it never exists
half-written and never replaces or follows what is already there. ``read_private_file``
opens with ``O_NOFOLLOW`` and checks the open descriptor, so the file checked is the
file read.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from forkd.errors import InvalidInput

GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
GROUP_OTHER_ANY = stat.S_IRWXG | stat.S_IRWXO


def private_dir(path: Path, owned_levels: int = 1) -> Path:
    """Create or check ``path`` as a private directory and return it (absolute).

    The last ``owned_levels`` components of ``path`` are forkd's: each is created mode
    0700 when missing and checked when it exists. Missing levels above them are
    created the same way; existing ones are checked as ancestors.
    """
    full = Path(os.path.abspath(path))
    levels = [full, *full.parents][::-1]  # "/" first
    first_owned = max(len(levels) - owned_levels, 1)
    for depth, level in enumerate(levels):
        if depth >= first_owned or not os.path.lexists(level):
            _make_owned(level)
        else:
            _check_ancestor(level)
    return full


def _make_owned(level: Path) -> None:
    with contextlib.suppress(FileExistsError):  # made before, by forkd or not: check decides
        os.mkdir(level, 0o700)
    check_owned_dir(level)


def check_owned_dir(level: Path) -> None:
    """Refuse ``level`` unless it is a real directory of this user, not group/other-writable."""
    st = os.lstat(level)
    if stat.S_ISLNK(st.st_mode):
        _refuse(level, "is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        _refuse(level, "is not a directory")
    if st.st_uid != os.geteuid():
        _refuse(level, f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & GROUP_OTHER_WRITE:
        _refuse(level, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def open_to_others(path: Path) -> str | None:
    """What group or others may do in the directory ``path`` that only its user should,
    e.g. "mode 0755: group and others may read it", or None when they may do nothing (or
    it does not exist). For a store's home or a hub's data directory: snapshots' memory
    (an agent's keys in its process memory) and private packs' blobs are in them."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    if not mode & GROUP_OTHER_ANY:
        return None
    return f"mode {mode:04o}: group or others may read or enter it"


def _check_ancestor(level: Path) -> None:
    link = os.lstat(level)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
        _refuse(level, f"is a symlink owned by uid {link.st_uid}, who could re-point it")
    for real in [Path(os.path.realpath(level)), *Path(os.path.realpath(level)).parents]:
        st = os.stat(real)
        if not stat.S_ISDIR(st.st_mode):
            _refuse(real, "is not a directory")
        if st.st_uid not in (0, os.geteuid()):
            _refuse(real, f"is owned by uid {st.st_uid}, who could replace what is inside it")
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & GROUP_OTHER_WRITE and not sticky:
            mode = stat.S_IMODE(st.st_mode)
            _refuse(real, f"is writable by group or others and not sticky (mode {mode:04o})")


def _refuse(level: Path, why: str) -> None:
    raise InvalidInput(
        f"{level} {why}: forkd keeps its sockets and secrets there and trusts only a "
        "directory of yours with mode 0700; remove it (or fix its owner and mode) and retry, "
        "or point FORKD_RUN at a directory of your own"
    )


def create_private_file(path: Path, data: bytes) -> bool:
    """Write ``data`` as the new private file ``path`` (mode 0600), all or nothing.

    Returns False, writing nothing, when ``path`` already exists (even as a symlink).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)  # never follows or replaces what is at path: EEXIST instead
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def read_private_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of the private file ``path``; refuses a symlink, a file that is not a
    regular file of this user, one group or others may access, or one over ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise InvalidInput(f"{path} is a symlink; use the file itself") from exc
        raise InvalidInput(f"{path}: cannot open: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise InvalidInput(
                f"{path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                "it must be your own file with mode 0600"
            )
        if st.st_mode & GROUP_OTHER_ANY:
            raise InvalidInput(
                f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may access "
                f"it; run `chmod 600 {path}`"
            )
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidInput(f"{path} is over {max_bytes} bytes; it must hold one short secret")
    return data
