"""The recorded working set in one request: a lazy server fetches the working-set blob
next to the pack (docs/pack-format.md, "Access order": the stored bytes of the recorded
chunks, concatenated in order) instead of a request per chunk, the hub's per-request
cost being most of what those chunks cost it; or reads it from the spool its fork
command streams it into (spool.py), checked all the same.

``fetch`` claims the chunks that are not here (``ChunkSource.claim``: a reader of one
waits for it), splits the stream at the chunk sizes the maps declare, and has each piece
checked against its digest, decompressed and checked (``ChunkSource.arrived``) on
``CHECKERS`` threads while the stream goes on. A piece that fails its check, or a stream
that breaks off, ends it: that chunk and the ones not yet read are given up
(``unclaim``), so their readers fetch them one by one (pieces already read are still
checked, each on its own), and no unchecked byte is ever served. Each memory chunk
is handed to ``on_chunk`` (a page-cache push) on a thread of its own: a push may wait for
a page a reader holds while that reader waits for a later chunk of this stream. Each
chunk is decoded once: its bytes stay with the source (pinned until handed on, the
others in its LRU), so a reader that overtakes the push is not a second decompression.

The blob is bounded in stored bytes, not in what they decode to (2 MiB of one repeated
byte is stored in a few dozen): a chunk that arrived is not held by its claim any more
(its waiting readers have it), and at most ``HANDING`` decoded chunks wait for their push;
a chunk past that is not pushed (reads produce its pages, as without a working set). The
checkers never wait for a push: a push may wait for a reader that waits for them.

A stream that brings no chunk (or no byte) for ``STREAM_STALL`` seconds ends as a broken
one: a hub that drips the working set holds a reader waiting for a claimed chunk that long
at most, then it fetches its chunk itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forkd import digest as dg
from forkd.engine.lazy.chunks import ChunkSource
from forkd.engine.lazy.spool import blocks as spooled
from forkd.errors import ForkdError
from forkd.pack.accessorder import working_set_chunks
from forkd.pack.manifest import Descriptor

CHECKERS = 2  # threads checking and decompressing the stream's chunks
STREAM_STALL = 10.0  # seconds the stream may go without bringing a chunk (or a byte)
# decoded memory chunks waiting for their page-cache push, at most (128 MiB): the pushes
# wait for QEMU's open of the memory file while the stream is decoded, and a chunk past
# this is not pushed but read by the child (issue 14: a first answer waits for its working
# set, langgraph-react's 105 chunks); 16 would skip most of what arrives before the open
HANDING = 64
log = logging.getLogger("forkd.lazy")


def stored_sizes(source: ChunkSource) -> dict[str, int]:
    """The stored size of each chunk of the source's chain, from its maps."""
    return {d: ref.stored for d, (ref, _) in source.refs.items()}


def held_chunks(source: ChunkSource, blob: Descriptor, order: list[str]) -> list[str]:
    """The first chunks of ``order`` working-set ``blob`` holds; IntegrityError when it
    does not fit the order (then it is not used)."""
    return working_set_chunks(order, stored_sizes(source), blob.size,
                              f"{source.name}: working set {dg.short(blob.digest)}")


def fetch(source: ChunkSource, blob: Descriptor, order: list[str],
          on_chunk: Callable[[str, bytes], object] | None = None,
          hand: Collection[str] = (), spool: Path | None = None) -> list[str]:
    """The chunks of working-set ``blob`` (the first chunks of ``order``) from the hub in
    one request, or from ``spool`` (the file the fork command streams it into: spool.py);
    the ones it brought. IntegrityError when the blob does not fit the order (it is not
    used then)."""
    hub = source.hub
    if hub is None and spool is None:
        return []
    what = f"{source.name}: working set {dg.short(blob.digest)}"
    stored = stored_sizes(source)
    held = working_set_chunks(order, stored, blob.size, what)
    claims = source.claim(held)
    brought: list[str] = []
    failed = threading.Event()
    lock = threading.Lock()
    handing_slots = threading.BoundedSemaphore(HANDING)
    checking = ThreadPoolExecutor(max_workers=CHECKERS, thread_name_prefix="working-set")
    handing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="working-set-hand")

    def check(digest: str, piece: bytes) -> None:
        if failed.is_set():
            return
        handed = hand_it(digest) and handing_slots.acquire(blocking=False)
        try:
            data = source.arrived(digest, piece, pin=handed)
        except ForkdError as exc:
            if handed:
                handing_slots.release()
            log.info("%s: %s; the rest come one by one", what, exc)
            failed.set()
            return
        with lock:
            brought.append(digest)
            del claims[digest]  # its readers have it: held here, every chunk would stay
        if handed:
            handing.submit(hand_on, digest, data)

    def hand_it(digest: str) -> bool:
        return on_chunk is not None and digest in hand

    def hand_on(digest: str, data: bytes) -> None:
        assert on_chunk is not None
        try:
            on_chunk(digest, data)
        finally:
            source.unpin(digest)
            handing_slots.release()

    def sink(blocks: Iterator[bytes]) -> None:
        buf = bytearray()
        at = 0  # chunks of held the stream has passed
        last = time.monotonic()  # when the stream last brought a chunk
        for block in blocks:
            if failed.is_set():
                return  # a chunk failed: stop reading
            buf.extend(block)
            while at < len(held) and len(buf) >= stored[held[at]]:
                digest, n = held[at], stored[held[at]]
                piece = bytes(buf[:n])
                del buf[:n]
                at += 1
                last = time.monotonic()
                with lock:
                    claimed = digest in claims  # else here already, or on its way
                if claimed:
                    checking.submit(check, digest, piece)
            if at < len(held) and time.monotonic() - last > STREAM_STALL:
                raise ForkdError(f"no chunk for {STREAM_STALL:.0f} s (at chunk {at + 1} of "
                                 f"{len(held)}, {held[at]}): the hub sends too slowly")

    try:
        if spool is not None:
            sink(spooled(spool, blob.size))
        elif hub is not None:
            hub.client.get_blob(hub.repo, blob.digest, blob.size, blob.size, sink,
                                read_timeout=STREAM_STALL)
    except (ForkdError, OSError) as exc:
        log.info("%s stopped after %d chunks (%s); the rest come one by one", what,
                 len(brought), exc)
    finally:
        checking.shutdown(wait=True)
        source.unclaim(claims)
        handing.shutdown(wait=True)
    return brought
