"""The lazy path's chunk source and image layout against a real store and a real hub (no
VM): bytes equal the assembled image's, only touched chunks travel, one fetch per chunk,
a chunk the hub corrupts is never stored nor served, a gone hub is named with the chunk."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hub_server import HubServer

from forkd import digest as dg
from forkd.engine.lazy.chunks import ChunkSource, ChunkUnavailable, open_local, open_remote
from forkd.engine.lazy.layout import ImageLayout
from forkd.errors import IntegrityError
from forkd.pack.accessorder import Order, decode, encode
from forkd.pack.imagemap import CHUNK_SIZE, PAGE_SIZE, ChunkRef
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import push
from forkd.store.blobs import FsBlobStore
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

SIZE = 6 * CHUNK_SIZE


@pytest.fixture
def chain_store(tmp_path: Path) -> tuple[Store, Path]:
    """A two-layer chain "app:v2" (a flat base and a diff), its head image at the path."""
    store = Store(tmp_path / "home")
    base, head = tmp_path / "base.img", tmp_path / "head.img"
    write_base(base, SIZE, seed=5, random_share=0.5)
    write_diff(base, head, share=0.1, seed=6)
    store.import_layer("app:v1", memory=base)
    store.import_layer("app:v2", memory=head, parent="app:v1")
    return store, head


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub").start()
    try:
        yield server
    finally:
        server.stop()


def _pushed(hub: HubServer, store: Store) -> tuple[str, tuple[str, str]]:
    who = hub.add_user("lazy")
    remote = f"{hub.address}/lazy/app:v2"
    with RegistryClient(hub.target, Credential(*who)) as client:
        push(store, "app:v2", parse_remote(remote), client)
    return remote, who


def test_layout_reads_the_assembled_image(chain_store: tuple[Store, Path]) -> None:
    store, head = chain_store
    layout = ImageLayout(open_local(store, "app:v2"), "memory")
    want = head.read_bytes()
    assert layout.size == len(want)
    assert layout.read(0, layout.size) == want
    for offset, length in [(0, 1), (PAGE_SIZE - 3, 10), (CHUNK_SIZE - 100, 300),
                           (5 * CHUNK_SIZE + 17, CHUNK_SIZE - 17), (SIZE - 1, 1)]:
        assert layout.read(offset, length) == want[offset : offset + length]


def test_remote_source_fetches_only_what_is_read(chain_store: tuple[Store, Path], hub: HubServer,
                                                 tmp_path: Path) -> None:
    store, head = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        layout = ImageLayout(source, "memory")
        assert source.fetched_chunks == 0 and len(source.missing()) == len(source.refs)
        offset = 2 * CHUNK_SIZE + 5 * PAGE_SIZE
        want = head.read_bytes()[offset : offset + 64 * PAGE_SIZE]
        touched = layout.chunks_at(offset, 64 * PAGE_SIZE)
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(
            layout.read(offset, 64 * PAGE_SIZE))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [want] * 8
        assert source.fetched_chunks == len(touched)  # concurrent readers: one fetch each
        source.flush()  # the store writer has them
        for d in touched:
            assert fresh.blobs.has(d)
        assert len(source.missing()) == len(source.refs) - len(touched)
        # the rest arrives through ensure (what the prefetch calls); then all is local
        for d in source.missing():
            assert source.ensure(d)
        source.fetch_files()
        source.flush()
        assert source.complete() and not source.missing()
        assert layout.read(0, SIZE) == head.read_bytes()
    assert fresh.verify() == []


def test_gone_hub_names_the_chunk(chain_store: tuple[Store, Path], hub: HubServer,
                                  tmp_path: Path) -> None:
    store, _ = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who), timeout=5) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        first = source.missing()[0]
        hub.stop()
        with pytest.raises(ChunkUnavailable) as caught:
            source.read(first)
    assert first in str(caught.value) and hub.address in str(caught.value)
    assert not fresh.blobs.has(first)
    assert fresh.verify() == []


def test_corrupt_chunk_from_the_hub_is_never_served(chain_store: tuple[Store, Path],
                                                    hub: HubServer, tmp_path: Path) -> None:
    store, _ = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        victim = source.missing()[0]
        on_hub = FsBlobStore(tmp_path / "hub" / "blobs").path(victim)
        if not on_hub.is_file():  # the hub's blob directory layout
            on_hub = next((tmp_path / "hub").rglob(victim.split(":")[1]))
        on_hub.chmod(0o644)
        data = bytearray(on_hub.read_bytes())
        data[len(data) // 2] ^= 0xFF
        on_hub.write_bytes(bytes(data))
        for _ in range(2):  # refused every time: nothing was kept
            with pytest.raises(IntegrityError, match=victim):
                source.read(victim)
        assert not fresh.blobs.has(victim)
    assert fresh.verify() == []


def test_local_source_without_hub_names_the_missing_chunk(chain_store: tuple[Store, Path]
                                                          ) -> None:
    store, _ = chain_store
    source = open_local(store, "app:v2")
    victim = next(iter(source.refs))
    store.blobs.delete(victim)
    with pytest.raises(ChunkUnavailable, match=victim):
        ChunkSource(store, source.chain, "app:v2").read(victim)


def test_access_order_travels_next_to_the_pack(chain_store: tuple[Store, Path], hub: HubServer,
                                               tmp_path: Path) -> None:
    from forkd.engine.lazy import orders
    from forkd.registry.transfer import pull

    store, head_image = chain_store
    remote, who = _pushed(hub, store)
    head = store.resolve("app:v2")
    with RegistryClient(hub.target, Credential(*who)) as client:
        assert orders.fetch(client, "lazy/app", head) is None  # none recorded yet
        chunks = list(open_local(store, "app:v2").refs)[::-1]
        orders.publish(client, "lazy/app", head, encode(head, Order(chunks, [3, 1])))
        assert orders.fetch(client, "lazy/app", head) == Order(chunks, [3, 1])
        # the pack itself is unchanged: same head digest, pulls and assembles as before
        other = Store(tmp_path / "other")
        assert pull(other, parse_remote(remote), client).digest == head
        assert other.assemble("lazy/app:v2").memory.read_bytes() == head_image.read_bytes()
        # an order recorded for another manifest is refused, not used
        with pytest.raises(IntegrityError, match="recorded for"):
            decode(encode(head, Order(chunks)), store.resolve("app:v1"), "order")


def test_fetched_chunk_is_served_before_the_store_write(chain_store: tuple[Store, Path],
                                                        hub: HubServer, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault waits for the fetch and one verification, not for the store's fsyncs: the
    chunk is served while the store writer is held up, decompressed once, counted as on
    its way by ensure, served again from the waiting blob, and in the store after flush."""
    from forkd.engine.lazy import chunks

    unpacked: list[int] = []

    real_unpack = chunks.unpack_chunk

    def counting(blob: bytes, ref: ChunkRef, what: str) -> bytes:
        unpacked.append(ref.size)
        return real_unpack(blob, ref, what)

    monkeypatch.setattr(chunks, "unpack_chunk", counting)
    store, head = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    gate = threading.Event()
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        source = ChunkSource(fresh, source.chain, source.name, source.hub, cached_chunks=0)
        layout = ImageLayout(source, "memory")
        source._writer.submit(gate.wait, 30)  # the store writer is busy elsewhere
        offset = 3 * CHUNK_SIZE
        (digest,) = layout.chunks_at(offset, PAGE_SIZE)
        want = head.read_bytes()[offset : offset + PAGE_SIZE]
        assert layout.read(offset, PAGE_SIZE) == want
        assert unpacked == [source.ref(digest).size]  # verified and decompressed once
        assert not fresh.blobs.has(digest) and not source.ensure(digest)
        assert layout.read(offset, PAGE_SIZE) == want  # no LRU: from the waiting blob
        assert source.fetched_chunks == 1
        gate.set()
        source.flush()
        assert fresh.blobs.has(digest)
        source.close()
    assert fresh.verify() == []


def test_held_writes_wait_until_opened_and_are_served_meanwhile(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    """``hold_writes`` (a lazy server while its first children start): fetched chunks are
    served, nothing reaches the store until ``open_writes``; then all of them do."""
    store, head = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        layout = ImageLayout(source, "memory")
        source.hold_writes()
        image = head.read_bytes()
        digests = []
        for offset in range(0, SIZE, CHUNK_SIZE):
            if len(layout.chunks_at(offset, PAGE_SIZE)) != 1:
                continue  # a hole there
            digests += layout.chunks_at(offset, PAGE_SIZE)
            assert layout.read(offset, PAGE_SIZE) == image[offset : offset + PAGE_SIZE]
        assert len(digests) >= 2
        threading.Event().wait(0.3)  # time the writer would need
        assert not any(fresh.blobs.has(d) for d in digests)  # held
        source.open_writes()
        source._writer.submit(lambda: None).result(timeout=30)
        assert all(fresh.blobs.has(d) for d in digests)
        source.close()
    assert fresh.verify() == []


def test_flush_opens_held_writes(chain_store: tuple[Store, Path], hub: HubServer,
                                 tmp_path: Path) -> None:
    """A server that exits before its children started still stores what it fetched."""
    store, _ = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        layout = ImageLayout(source, "memory")
        source.hold_writes()
        (digest,) = layout.chunks_at(3 * CHUNK_SIZE, PAGE_SIZE)
        layout.read(3 * CHUNK_SIZE, PAGE_SIZE)
        source.flush()
        assert fresh.blobs.has(digest)
        source.close()


def test_working_set_fetch_stores_checked_chunks_and_refuses_corrupt_ones(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    """fetch_into_store (what a lazy fork does while its server starts): the chunk is in
    the store, checked, and reads of it fetch nothing more; a chunk the hub corrupts is
    refused and not stored."""
    store, head = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        good, victim = source.missing()[:2]
        assert source.fetch_into_store(good) is True
        assert fresh.blobs.has(good) and source.fetch_into_store(good) is False
        layout = ImageLayout(source, "memory")
        segment = layout.by_chunk[good][0]
        offset, length = segment.page * PAGE_SIZE, segment.count * PAGE_SIZE
        fetched = source.fetched_chunks
        assert layout.read(offset, length) == head.read_bytes()[offset : offset + length]
        assert source.fetched_chunks == fetched, "a stored chunk was fetched again"
        on_hub = next((tmp_path / "hub").rglob(victim.split(":")[1]))
        on_hub.chmod(0o644)
        data = bytearray(on_hub.read_bytes())
        data[len(data) // 2] ^= 0xFF
        on_hub.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=victim):
            source.fetch_into_store(victim)
        assert not fresh.blobs.has(victim)
    assert fresh.verify() == []


def test_placed_gives_a_chunks_pages_where_the_image_has_them(
        chain_store: tuple[Store, Path]) -> None:
    store, head = chain_store
    source = open_local(store, "app:v2")
    layout = ImageLayout(source, "memory")
    want = head.read_bytes()
    covered = 0
    for digest in layout.by_chunk:
        for offset, piece in layout.placed(digest, source.read(digest)):
            assert bytes(piece) == want[offset : offset + len(piece)]
            covered += len(piece)
    assert covered == sum(s.count for s in layout.segments) * PAGE_SIZE
    assert layout.placed("sha256:" + "0" * 64, b"") == []


def _published_working_set(hub: HubServer, store: Store, who: tuple[str, str],
                           chunks: list[str], tamper: str | None = None) -> Order:
    """The order of ``chunks`` and its working set on the hub (``tamper``: that chunk's
    bytes altered in the blob, which is pushed under its own, matching digest); what a
    lazy fork finds there."""
    from forkd.engine.lazy import orders

    head = store.resolve("app:v2")
    working_set = orders.WorkingSet(store, chunks)
    if tamper is not None:
        whole = bytearray(working_set.read(0, working_set.descriptor.size))
        at = working_set.starts[chunks.index(tamper)]
        whole[at + 10] ^= 0xFF
        tampered = bytes(whole)
        working_set.read = lambda offset, size: tampered[offset : offset + size]  # type: ignore[method-assign]
        working_set.descriptor = replace(working_set.descriptor, digest=dg.of_bytes(tampered))
    with RegistryClient(hub.target, Credential(*who)) as client:
        orders.publish(client, "lazy/app", head, encode(head, Order(chunks)), working_set)
        found = orders.fetch(client, "lazy/app", head)
    assert found is not None and found.working_set is not None
    assert found.working_set.digest == working_set.descriptor.digest
    return found


def test_the_working_set_comes_in_one_request_each_chunk_checked(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    """workingset.fetch: every chunk of the working set not here arrives from its one
    blob, checked, and is served and stored; readers waiting for one get it; nothing
    else is fetched."""
    from forkd.engine.lazy import workingset

    store, head = chain_store
    remote, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        handed: list[str] = []
        brought = workingset.fetch(source, order.working_set, order.chunks,
                                   lambda d, data: handed.append(d), set(chunks[:2]))
        assert sorted(brought) == sorted(chunks) and sorted(handed) == sorted(chunks[:2])
        assert source.fetched_chunks == len(chunks)
        layout = ImageLayout(source, "memory")
        for digest in chunks:
            for segment in layout.by_chunk.get(digest, []):
                offset, length = segment.page * PAGE_SIZE, segment.count * PAGE_SIZE
                assert layout.read(offset, length) == head.read_bytes()[offset : offset + length]
        assert source.fetched_chunks == len(chunks), "a streamed chunk was fetched again"
        source.close()
    assert all(fresh.blobs.has(d) for d in chunks)
    assert fresh.verify() == []


def test_a_streamed_chunk_is_decoded_once(chain_store: tuple[Store, Path], hub: HubServer,
                                         tmp_path: Path) -> None:
    """A reader of a working-set chunk gets the bytes the stream's check decoded: while
    the chunk is being handed on (a page-cache push the reader overtook) and, for the
    chunks not handed on, afterwards (the source's LRU). None is decompressed twice."""
    from forkd.engine.lazy import workingset

    store, head = chain_store
    remote, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    image = head.read_bytes()
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        layout = ImageLayout(source, "memory")

        def segment_of(digest: str) -> tuple[int, int]:
            segment = layout.by_chunk[digest][0]
            return segment.page * PAGE_SIZE, segment.count * PAGE_SIZE

        overtaken: list[bool] = []

        def hand(digest: str, data: bytes) -> None:  # a reader comes before the push ends
            offset, length = segment_of(digest)
            overtaken.append(layout.read(offset, length) == image[offset : offset + length])

        handed = {d for d in chunks[:2] if d in layout.by_chunk}
        workingset.fetch(source, order.working_set, order.chunks, hand, handed)
        assert overtaken == [True] * len(handed)
        assert source.decoded == len(chunks), "a reader decoded a streamed chunk again"
        for digest in chunks[2:]:
            if digest in layout.by_chunk:
                offset, length = segment_of(digest)
                assert layout.read(offset, length) == image[offset : offset + length]
        assert source.decoded == len(chunks)
        source.close()


@pytest.mark.parametrize("via", ["hub", "spool"])
def test_a_tampered_working_set_chunk_is_never_served(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path, via: str) -> None:
    """A working set whose third chunk's bytes differ from the chunk its map names, read
    from the hub's stream or from the spool a fork command streamed it into (a buffer,
    not a trusted source): the stream stops there, that chunk is neither served nor stored
    from it (the others it brought each checked out), and a reader of it gets the true
    chunk by a single fetch."""
    from forkd.engine.lazy import spool, workingset

    store, head = chain_store
    remote, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, chunks, tamper=chunks[2])
    assert order.working_set is not None
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        path = tmp_path / "server" / spool.SPOOL_NAME
        spooler = (spool.Spooler(client, "lazy/app", order.working_set, path)
                   if via == "spool" else None)
        source = open_remote(fresh, parse_remote(remote), client)
        brought = workingset.fetch(source, order.working_set, order.chunks,
                                   spool=path if spooler is not None else None)
        if spooler is not None:
            spooler.wait()
        assert chunks[2] not in brought and set(brought) <= set(chunks)
        assert not source.local(chunks[2])
        ref = source.ref(chunks[2])
        assert dg.of_bytes(store.blobs.read(chunks[2], ref.stored)) == chunks[2]
        layout = ImageLayout(source, "memory")
        segment = layout.by_chunk[chunks[2]][0]
        offset, length = segment.page * PAGE_SIZE, segment.count * PAGE_SIZE
        assert layout.read(offset, length) == head.read_bytes()[offset : offset + length]
        source.close()
    assert fresh.verify() == []


def test_a_working_set_that_does_not_fit_its_order_is_not_used(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    from forkd.engine.lazy import workingset

    store, _ = chain_store
    remote, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:3]
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        with pytest.raises(IntegrityError, match="do not add up"):
            workingset.fetch(source, order.working_set, chunks[1:])
        assert source.fetched_chunks == 0
        source.close()


class _Gated:
    """prefetch.run in a thread of its own, held at ``before_rest`` until ``go``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        from forkd.engine.lazy import prefetch

        self.go, self.waiting = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=prefetch.run, args=args,
                                       kwargs={**kwargs, "before_rest": self._before_rest})
        self.thread.start()

    def _before_rest(self) -> None:
        self.waiting.set()
        assert self.go.wait(30)

    def finish(self) -> None:
        self.go.set()
        self.thread.join(60)


def test_the_rest_of_the_chain_waits_for_before_rest(chain_store: tuple[Store, Path],
                                                     hub: HubServer, tmp_path: Path) -> None:
    """prefetch.run: the recorded chunks come first; nothing else is fetched until
    ``before_rest`` returns (the server holds it until the command's children are
    started), then the whole chain comes and is tagged."""
    from forkd.engine.lazy import prefetch

    store, _ = chain_store
    remote, who = _pushed(hub, store)
    recorded = list(open_local(store, "app:v2").refs)[:2]
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        order = prefetch.plan(source, recorded, list(source.refs))
        progress = prefetch.Progress()
        report = tmp_path / "prefetch.json"
        run = _Gated(source, order, len(recorded), progress, report, "app:v2")
        try:
            assert run.waiting.wait(30), "the recorded chunks did not arrive"
            assert source.fetched_chunks == len(recorded)
            saved = prefetch.read_progress(report)
            assert saved is not None and saved.state == "running"
            assert saved.fetched == len(recorded) and saved.recorded_seconds > 0
        finally:
            run.finish()
        assert progress.state == "done", progress.error
        assert source.fetched_chunks == len(source.refs) > len(recorded)
        source.close()
    assert fresh.tags.read().get("app:v2") == source.head
    assert fresh.verify() == []


def test_recorded_chunks_past_the_working_set_wait_for_before_rest(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    """prefetch.run with a working set that holds the first two of four recorded chunks
    (engine/lazy/record.py: the chunks of the pages a child touched; the others only its
    read-ahead needed): until ``before_rest`` returns only those two arrive, in the
    working set's one request; then the rest of the chain, recorded ones first."""
    from forkd.engine.lazy import prefetch

    store, _ = chain_store
    remote, who = _pushed(hub, store)
    recorded = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, recorded[:2])
    assert order.working_set is not None
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        plan = prefetch.plan(source, recorded, list(source.refs))
        progress = prefetch.Progress()
        run = _Gated(source, plan, len(recorded), progress, tmp_path / "prefetch.json",
                     "app:v2", working_set=order.working_set)
        try:
            assert run.waiting.wait(30), "the working set did not arrive"
            assert progress.streamed == 2 and source.fetched_chunks == 2  # one request
            assert all(source.local(d) for d in recorded[:2])
            assert not any(source.local(d) for d in recorded[2:])
        finally:
            run.finish()
        assert progress.state == "done", progress.error
        assert all(source.local(d) for d in source.refs)
        source.close()
    assert fresh.tags.read().get("app:v2") == source.head


def test_the_working_set_from_the_spool_is_checked_and_served(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    """The fork command's spool (spool.Spooler, against the hub) read by workingset.fetch
    as it grows: every chunk checked, served and stored, none fetched again, the file
    removable."""
    from forkd.engine.lazy import spool, workingset

    store, head = chain_store
    remote, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    image = head.read_bytes()
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    fresh = Store(tmp_path / "fresh")
    path = tmp_path / "server" / spool.SPOOL_NAME
    with RegistryClient(hub.target, Credential(*who)) as client:
        spooler = spool.Spooler(client, "lazy/app", order.working_set, path)
        source = open_remote(fresh, parse_remote(remote), client)
        brought = workingset.fetch(source, order.working_set, order.chunks, spool=path)
        spooler.wait()
        assert sorted(brought) == sorted(chunks)
        assert spool.done_path(path).read_text() == ""  # the whole blob came
        assert path.stat().st_size == order.working_set.size
        fetched = source.fetched_chunks
        layout = ImageLayout(source, "memory")
        for digest in chunks:
            for segment in layout.by_chunk.get(digest, []):
                offset, length = segment.page * PAGE_SIZE, segment.count * PAGE_SIZE
                assert layout.read(offset, length) == image[offset : offset + length]
        assert source.fetched_chunks == fetched, "a spooled chunk was fetched again"
        source.close()
    spool.remove(path)
    assert not path.exists() and not spool.done_path(path).exists()
    assert all(fresh.blobs.has(d) for d in chunks)
    assert fresh.verify() == []


def test_a_discarded_spool_stops_and_leaves_nothing(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path) -> None:
    from forkd.engine.lazy import spool

    store, _ = chain_store
    _, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    path = tmp_path / "server" / spool.SPOOL_NAME
    with RegistryClient(hub.target, Credential(*who)) as client:
        spooler = spool.Spooler(client, "lazy/app", order.working_set, path)
        spooler.discard()
        spooler.wait(60)
    assert list(path.parent.iterdir()) == []


def test_the_working_set_is_named_before_the_order_blob_comes(
        chain_store: tuple[Store, Path], hub: HubServer) -> None:
    """orders.fetch names the fitting working set (a fork starts streaming it then) as soon
    as the order's manifest is read, before the order's own blob: with that blob gone from
    the hub the working set was named all the same, and the fetch finds no order (the
    fork then discards its spool)."""
    from forkd.engine.lazy import orders

    store, _ = chain_store
    _, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:3]
    found = _published_working_set(hub, store, who, chunks)
    head = store.resolve("app:v2")
    heard: list[object] = []
    with RegistryClient(hub.target, Credential(*who)) as client:
        again = orders.fetch(client, "lazy/app", head, heard.append)
        assert again is not None and heard == [found.working_set] == [again.working_set]
        order_blob = dg.of_bytes(encode(head, Order(chunks)))
        for path in hub.data_dir.rglob(order_blob.split(":")[1]):
            path.unlink()
        heard.clear()
        assert orders.fetch(client, "lazy/app", head, heard.append) is None
        assert heard == [found.working_set]


def test_a_closed_source_ends_its_prefetch_cleanly(chain_store: tuple[Store, Path],
                                                  hub: HubServer, tmp_path: Path) -> None:
    """A server closes its chunk source as it stops (its last child is gone) while the
    prefetch of the rest may still run: a read after that is ChunkUnavailable saying so,
    and the prefetch ends "failed" with that reason (no traceback in a thread, nothing
    half-stored)."""
    from forkd.engine.lazy import prefetch

    store, _ = chain_store
    remote, who = _pushed(hub, store)
    fresh = Store(tmp_path / "fresh")
    with RegistryClient(hub.target, Credential(*who)) as client:
        source = open_remote(fresh, parse_remote(remote), client)
        first = next(iter(source.refs))
        source.close()
        with pytest.raises(ChunkUnavailable, match="lazy server stopped"):
            source.read(first)
        progress = prefetch.Progress()
        prefetch.run(source, list(source.refs), 0, progress, tmp_path / "prefetch.json", None)
    assert progress.state == "failed" and "lazy server stopped" in (progress.error or "")
    assert not any(fresh.blobs.has(d) for d in source.refs)
    assert fresh.verify() == []


def test_a_dripping_chunk_fails_by_its_deadline_naming_it(
        chain_store: tuple[Store, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub dripping a chunk a byte at a time (tests/hostile_hub.py) holds a lazy fault
    until the chunk's deadline only: then ChunkUnavailable names the chunk, nothing of it is
    stored, and the other chunks are served as before."""
    from hostile_hub import HostileHub

    from forkd.registry import client as registry_client

    store, head = chain_store
    monkeypatch.setattr(registry_client, "BLOB_GRACE", 1.5)
    monkeypatch.setattr(registry_client, "MIN_BLOB_RATE", 1 << 30)
    fresh = Store(tmp_path / "fresh")
    with HostileHub(store, {"v2": store.resolve("app:v2")}, pause=0.2) as hostile, \
            RegistryClient(hostile.hub) as client:
        source = open_remote(fresh, parse_remote(f"{hostile.hub.host}/lazy/app:v2"), client)
        layout = ImageLayout(source, "memory")
        victim, other = layout.chunk_order[0], layout.chunk_order[-1]
        hostile.modes[victim] = "drip"
        start = time.monotonic()
        with pytest.raises(ChunkUnavailable) as caught:
            source.read(victim)
        assert time.monotonic() - start < 15
        assert victim in str(caught.value) and "too slowly" in str(caught.value)
        at = layout.by_chunk[other][0].page * PAGE_SIZE
        assert layout.read(at, PAGE_SIZE) == head.read_bytes()[at : at + PAGE_SIZE]
        source.flush()
        assert not fresh.blobs.has(victim) and fresh.blobs.has(other)
    assert fresh.verify() == []


def test_a_dripping_working_set_leaves_its_chunks_to_readers(
        chain_store: tuple[Store, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub dripping the working-set blob (tests/hostile_hub.py) stops being read after
    STREAM_STALL seconds without a chunk: a reader waiting for a chunk the stream claimed
    fetches it itself then, and gets its verified bytes, instead of waiting for the
    blob's whole deadline."""
    from hostile_hub import HostileHub

    from forkd.engine.lazy import orders, workingset

    store, head = chain_store
    monkeypatch.setattr(workingset, "STREAM_STALL", 1.0)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    whole = orders.WorkingSet(store, chunks)
    blob = whole.descriptor
    store.blobs.put_bytes(whole.read(0, blob.size), blob.digest)  # on the hostile hub
    fresh = Store(tmp_path / "fresh")
    with HostileHub(store, {"v2": store.resolve("app:v2")}, pause=0.2) as hostile, \
            RegistryClient(hostile.hub) as client:
        hostile.modes[blob.digest] = "drip"
        source = open_remote(fresh, parse_remote(f"{hostile.hub.host}/lazy/app:v2"), client)
        layout = ImageLayout(source, "memory")
        brought: list[list[str]] = []
        streaming = threading.Thread(target=lambda: brought.append(
            workingset.fetch(source, blob, chunks)))
        start = time.monotonic()
        streaming.start()
        while not source._inflight:  # the stream's claims are made
            assert time.monotonic() < start + 60 and streaming.is_alive(), "no claims made"
            time.sleep(0.01)
        victim = next(d for d in chunks if d in layout.by_chunk)
        segment = layout.by_chunk[victim][0]
        at, length = segment.page * PAGE_SIZE, segment.count * PAGE_SIZE
        assert layout.read(at, length) == head.read_bytes()[at : at + length]
        assert time.monotonic() - start < 10
        streaming.join(10)
        assert not streaming.is_alive() and brought == [[]]
        source.close()
    assert fresh.verify() == []


def test_a_hub_listing_thousands_of_working_sets_costs_a_few_fetches(
        chain_store: tuple[Store, Path]) -> None:
    """A hub (or the pack's publisher) listing many working sets of a snapshot, each cut
    from another order: a lazy fork looks at the newest MAX_WORKING_SETS only, not one
    manifest fetch per listed artifact."""
    from hostile_hub import HostileHub

    from forkd.engine.lazy import orders
    from forkd.pack import accessorder as ao
    from forkd.pack import mediatypes as mt
    from forkd.pack.manifest import Descriptor

    store, _ = chain_store
    head = store.resolve("app:v2")
    subject = Descriptor(mt.OCI_MANIFEST, head, store.blobs.size(head))
    chunks = list(open_local(store, "app:v2").refs)[:2]
    order = encode(head, Order(chunks))
    store.blobs.put_bytes(order)
    store.blobs.put_bytes(ao.EMPTY_CONFIG)
    order_artifact = store.blobs.put_bytes(ao.artifact(subject, order))
    blob = orders.WorkingSet(store, chunks).descriptor
    others = [store.blobs.put_bytes(ao.working_set_artifact(
        subject, dg.of_bytes(f"another order {i}".encode()), blob)) for i in range(200)]
    with HostileHub(store, {}) as hostile, RegistryClient(hostile.hub) as client:
        hostile.referrers = {ao.ACCESS_ORDER_ARTIFACT: [order_artifact],
                             ao.WORKING_SET_ARTIFACT: others}
        found = orders.fetch(client, "lazy/app", head)
        asked = [p for p in hostile.requests if p.rsplit("/", 1)[-1] in set(others)]
    assert found is not None and found.chunks == chunks and found.working_set is None
    assert len(asked) == orders.MAX_WORKING_SETS


def test_a_garbled_chunk_answer_is_unavailable_naming_it(
        chain_store: tuple[Store, Path], tmp_path: Path) -> None:
    """A chunk whose answer says gzip and is not: ChunkUnavailable naming the chunk (what
    a FUSE read turns into EIO), not a raw httpx error out of the server's read handler."""
    from hostile_hub import HostileHub

    store, _ = chain_store
    fresh = Store(tmp_path / "fresh")
    with HostileHub(store, {"v2": store.resolve("app:v2")}) as hostile, \
            RegistryClient(hostile.hub) as client:
        source = open_remote(fresh, parse_remote(f"{hostile.hub.host}/lazy/app:v2"), client)
        victim = next(iter(source.refs))
        hostile.modes[victim] = "garbled"
        with pytest.raises(ChunkUnavailable, match=victim):
            source.read(victim)
        source.close()
    assert not fresh.blobs.has(victim) and fresh.verify() == []


def test_a_working_set_over_its_bound_is_not_used(
        chain_store: tuple[Store, Path], hub: HubServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher keeps its working set within MAX_WORKING_SET_BYTES (bounded_prefix); a
    reader refuses a larger one as its artifact is read, before a byte of its blob is
    spooled or streamed (a hostile hub's could declare any size), and goes chunk by
    chunk: the order itself still counts."""
    from forkd.engine.lazy import orders
    from forkd.pack import accessorder

    store, _ = chain_store
    _, who = _pushed(hub, store)
    chunks = list(open_local(store, "app:v2").refs)[:4]
    order = _published_working_set(hub, store, who, chunks)
    assert order.working_set is not None
    sizes = [store.blobs.size(d) for d in chunks]
    monkeypatch.setattr(accessorder, "MAX_WORKING_SET_BYTES", sizes[0] + sizes[1])
    assert accessorder.bounded_prefix(chunks, store.blobs.size) == chunks[:2]
    named: list[object] = []
    with RegistryClient(hub.target, Credential(*who)) as client:
        found = orders.fetch(client, "lazy/app", store.resolve("app:v2"), named.append)
    assert found is not None and found.chunks == chunks
    assert found.working_set is None and named == []


def test_every_chunk_of_a_touched_page_is_in_the_working_set(
        chain_store: tuple[Store, Path]) -> None:
    """record.working_set with the pages a child touched: the order's chunks less the
    memory chunks holding none of them, then the touched pages' chunks the order missed.
    Before, those were left out: the recording child's server had pushed them into the
    page cache with the window around an earlier read, so its order never listed them,
    and a child on another host fetched each from the hub before its first answer."""
    import json

    from forkd.engine.lazy import record
    from forkd.engine.lazy.paths import server_dir
    from forkd.store.worksplit import pages_of

    store, _ = chain_store
    head = store.resolve("app:v1")  # the flat base: many memory chunks
    memory = store.image_map(store.manifest(head), "memory", head)
    assert memory is not None and len(memory.chunks) >= 3
    listed, missed, cold = memory.chunks[0], memory.chunks[2], memory.chunks[1]
    touched = [pages_of(listed)[0], pages_of(missed)[-1]]
    path = server_dir(store.home, head) / record.TOUCHED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"manifest": head, "from": head,
                                "pages": [[p, 1] for p in touched]}))
    order = Order([cold.digest, listed.digest])  # missed: pushed whole, never read
    got = record.working_set(store, head, order)
    assert got == [listed.digest, missed.digest]
    assert record.working_set(store, head, Order([missed.digest])) == [missed.digest,
                                                                      listed.digest]
