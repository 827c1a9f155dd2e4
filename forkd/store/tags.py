"""Tags → manifest digests, in one JSON file updated atomically under a file lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError, InvalidInput
from forkd.names import parse_ref

MAX_TAGS_BYTES = 64 << 20


@contextlib.contextmanager
def flock(path: Path, exclusive: bool) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class TagIndex:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = path.with_suffix(".lock")

    def read(self) -> dict[str, str]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        if len(data) > MAX_TAGS_BYTES:
            raise IntegrityError(f"{self.path} is over {MAX_TAGS_BYTES} bytes; it is corrupt")
        try:
            raw = jsondoc.loads(data, str(self.path))
            tags = {str(parse_ref(k)): dg.validate(v) for k, v in raw.items()}
        except (InvalidInput, ValueError, AttributeError) as exc:
            raise IntegrityError(
                f"{self.path} is corrupt ({exc}); restore it from a backup or re-import the tags"
            ) from exc
        return tags

    def update(self, change: Callable[[dict[str, str]], None]) -> dict[str, str]:
        """Apply ``change`` to the tags under an exclusive lock and publish atomically."""
        with flock(self.lock, exclusive=True):
            tags = self.read()
            change(tags)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tags-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(dict(sorted(tags.items())), f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return tags
