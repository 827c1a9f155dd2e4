"""The working-set blob spooled by the fork command for the server it starts.

A new lazy server could ask the hub for the recorded working set only once it runs: after
the chain is resolved, its process told its directory, the chain's maps parsed and its
own login done. The fork command knows the blob as soon as it has the access order (a
request next to the head manifest's) and is logged in already, so it streams the blob
into ``working-set.spool`` in the server's directory from then on (``Spooler``); the
server reads the file as it grows (``blocks``) instead of asking the hub, and removes it
once read. Every chunk of it is checked as the hub's stream is (workingset.py): the spool
is a buffer, never trusted.

The writer ends with ``working-set.spool.done``: empty when the whole blob is in the
file, else what went wrong (a blob that would take the store's disk past its reserve is
refused before a byte is written: NoRoom). A reader that finds the blob short, or no byte coming for
``STALL`` seconds and no end written (its command died), stops there: the chunks not read
come one by one (workingset.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from forkd.errors import ForkdError
from forkd.pack.manifest import Descriptor
from forkd.registry.client import RegistryClient, RegistryError
from forkd.store.blobs import free_space
from forkd.store.fetch import check_free

SPOOL_NAME = "working-set.spool"
DONE_SUFFIX = ".done"
BLOCK = 1 << 20  # bytes a reader takes at once
STALL = 10.0  # seconds without a new byte (and no end written) before a reader gives up
POLL = 0.002  # seconds between a reader's looks at a file that has not grown


def done_path(spool: Path) -> Path:
    return spool.with_name(spool.name + DONE_SUFFIX)


class Spooler:
    """Streams ``blob`` of ``repo`` from the hub into ``path`` on a thread of its own."""

    def __init__(self, client: RegistryClient, repo: str, blob: Descriptor, path: Path) -> None:
        self.path = path
        done_path(path).unlink(missing_ok=True)  # an earlier command's
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._discarded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, repo, blob),
                                        name="working-set-spool", daemon=True)
        self._thread.start()

    def _run(self, client: RegistryClient, repo: str, blob: Descriptor) -> None:
        def sink(blocks: Iterator[bytes]) -> None:
            for block in blocks:
                if self._discarded.is_set():
                    raise _Discarded
                view = memoryview(block)
                while view:
                    view = view[os.write(self._fd, view):]

        outcome = ""
        try:
            # the hub's word, streamed before the chain's own room check (open_remote)
            check_free(free_space(self.path.parent), blob.size, "the working set's spool",
                       self.path.parent)
            client.get_blob(repo, blob.digest, blob.size, blob.size, sink)
        except _Discarded:
            outcome = "discarded"
        except (ForkdError, OSError) as exc:
            outcome = str(exc) or type(exc).__name__
        finally:
            os.close(self._fd)
            tmp = done_path(self.path).with_suffix(".tmp")
            with contextlib.suppress(OSError):
                tmp.write_text(outcome)
                tmp.replace(done_path(self.path))
            if self._discarded.is_set():
                remove(self.path)

    def wait(self, timeout: float | None = None) -> None:
        """Until the blob is in the file (or the stream ended)."""
        self._thread.join(timeout)

    def discard(self) -> None:
        """Not needed (a server runs already, or none started): the stream stops at its
        next block and the files go."""
        self._discarded.set()
        remove(self.path)


class _Discarded(Exception):
    """The spool was discarded while its stream went on."""


def remove(spool: Path) -> None:
    spool.unlink(missing_ok=True)
    done_path(spool).unlink(missing_ok=True)


def blocks(spool: Path, size: int, stall: float = STALL) -> Iterator[bytes]:
    """The ``size`` bytes of ``spool`` as its writer adds them. RegistryError when the
    writer ended short (its error), or wrote nothing new for ``stall`` seconds."""
    with open(spool, "rb", buffering=0) as f:
        got = 0
        last = time.monotonic()
        while got < size:
            block = f.read(min(BLOCK, size - got))
            if block:
                got += len(block)
                last = time.monotonic()
                yield block
                continue
            done = done_path(spool)
            if done.exists():  # everything it wrote is in the file before its end
                block = f.read(min(BLOCK, size - got))
                if block:
                    got += len(block)
                    yield block
                    continue
                why = done.read_text(errors="replace")[:500] or "the file is short"
                raise RegistryError(f"the working set's spool {spool} ended after {got} of "
                                    f"{size} bytes: {why}")
            if time.monotonic() - last > stall:
                raise RegistryError(f"the working set's spool {spool} got no byte for {stall} "
                                    f"s after {got} of {size} (its fork command is gone)")
            time.sleep(POLL)


__all__ = ["SPOOL_NAME", "Spooler", "blocks", "done_path", "remove"]
