"""One conformance suite for every BlobStore backend: FsBlobStore and S3BlobStore.

S3 runs against a real ``moto_server`` subprocess (``MotoServer``, also used by the hub's
S3 tests), one per session, a fresh bucket per test. Like distribution's driver test
suite, every test also fails if the backend is left with anything but published blobs
(temporary files or keys, unfinished multipart uploads).
"""

from __future__ import annotations

import io
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from s3_support import MOTO_CREDENTIALS, MotoServer, free_port, s3_leftovers

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.store.blobs import BlobStore, FsBlobStore
from forkd.store.s3 import MIN_PART_SIZE, S3BlobStore, make_client

MiB = 1 << 20


@dataclass
class Backend:
    """A store under test, and what the suite needs to look behind its back."""

    store: BlobStore
    corrupt: Callable[[str, bytes], None]  # replace a stored blob's bytes
    leftovers: Callable[[], list[str]]  # anything but published blobs


def _fs_backend(root: Path) -> Backend:
    store = FsBlobStore(root)

    def corrupt(digest: str, data: bytes) -> None:
        path = store.path(digest)
        path.chmod(0o644)
        path.write_bytes(data)

    return Backend(store, corrupt, lambda: [p.name for p in store.tmp.iterdir()])


def _s3_backend(server: MotoServer) -> Backend:
    client, bucket = server.client(), server.new_bucket()
    store = S3BlobStore(client, bucket, "hub/", part_size=MIN_PART_SIZE)

    def corrupt(digest: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=store.key(digest), Body=data)

    return Backend(store, corrupt, lambda: s3_leftovers(client, bucket, store.prefix))


@pytest.fixture(params=["fs", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "fs":
        made = _fs_backend(tmp_path / "blobs")
    else:
        made = _s3_backend(request.getfixturevalue("moto_server"))
    yield made
    assert made.leftovers() == [], "the backend kept temporary state"


def blob(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def chunks(data: bytes, size: int = MiB) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_put_then_read_has_size_digests_mtime(backend: Backend) -> None:
    store = backend.store
    data = b"hello blob store"
    digest = store.put_bytes(data)
    assert digest == dg.of_bytes(data)
    assert store.put_bytes(data, digest) == digest  # same content again: fine
    assert store.has(digest) and store.size(digest) == len(data)
    assert store.read(digest, len(data)) == data
    assert list(store.digests()) == [digest]
    assert abs(store.mtime(digest) - time.time()) < 300
    empty = store.put_bytes(b"")
    assert store.read(empty, 0) == b"" and store.size(empty) == 0
    assert sorted(store.digests()) == sorted([digest, empty])


@pytest.mark.parametrize("known", [True, False], ids=["expected-digest", "digest-unknown"])
def test_large_streamed_blob_round_trips(backend: Backend, known: bool) -> None:
    """12 MiB: more than two parts on S3 (5 MiB parts here), with and without the digest."""
    data = blob(12 * MiB + 123)
    expected = dg.of_bytes(data) if known else None
    size = len(data) if known else None
    digest = backend.store.put_stream(chunks(data), expected, size)
    assert digest == dg.of_bytes(data)
    assert backend.store.size(digest) == len(data)
    assert backend.store.read(digest, len(data)) == data
    with backend.store.open(digest) as f:
        assert dg.of_file(f) == digest


@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["small", "multipart"])
def test_digest_mismatch_stores_nothing(backend: Backend, size: int) -> None:
    data = blob(size)
    claimed = dg.of_bytes(data + b"!")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        backend.store.put_stream(chunks(data), claimed)
    with pytest.raises(IntegrityError, match="digest mismatch"):
        backend.store.put_bytes(data, claimed)
    assert not backend.store.has(claimed) and not backend.store.has(dg.of_bytes(data))
    assert list(backend.store.digests()) == []


@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["small", "multipart"])
def test_truncated_or_overlong_stream_stores_nothing(backend: Backend, size: int) -> None:
    data = blob(size)
    digest = dg.of_bytes(data)
    with pytest.raises(IntegrityError, match="truncated"):
        backend.store.put_stream(chunks(data[:-1]), digest, len(data))
    with pytest.raises(IntegrityError, match="larger than its declared size"):
        backend.store.put_stream(chunks(data), digest, len(data) - 1)
    with pytest.raises(IntegrityError, match="truncated"):  # size checked without a digest too
        backend.store.put_stream(chunks(data[:-1]), None, len(data))
    assert list(backend.store.digests()) == []


def test_stream_failing_midway_stores_nothing(backend: Backend) -> None:
    data = blob(12 * MiB)

    def broken() -> Iterator[bytes]:
        yield from chunks(data[: 11 * MiB])
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        backend.store.put_stream(broken(), dg.of_bytes(data))
    assert list(backend.store.digests()) == []


def test_known_blob_is_not_read_again(backend: Backend) -> None:
    digest = backend.store.put_bytes(b"already here")

    def untouched() -> Iterator[bytes]:
        raise AssertionError("the store read a stream for content it has")
        yield b""

    assert backend.store.put_stream(untouched(), digest) == digest


def test_concurrent_puts_of_the_same_blob(backend: Backend) -> None:
    data = blob(6 * MiB + 7)  # two parts on S3
    digest = dg.of_bytes(data)
    barrier = threading.Barrier(6)
    results: list[str] = []
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            barrier.wait()
            got = backend.store.put_stream(chunks(data), digest if i % 2 else None)
            results.append(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and results == [digest] * 6
    assert list(backend.store.digests()) == [digest]
    assert backend.store.read(digest, len(data)) == data


def test_reads_are_bounded_and_verified(backend: Backend) -> None:
    data = blob(4096)
    digest = backend.store.put_bytes(data)
    with pytest.raises(InvalidInput, match="over the limit"):
        backend.store.read(digest, len(data) - 1, "manifest")
    backend.corrupt(digest, data[:-1] + b"\0")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        backend.store.read(digest, len(data))


def test_open_streams_and_seeks(backend: Backend) -> None:
    data = blob(3 * MiB + 5)
    digest = backend.store.put_bytes(data)
    with backend.store.open(digest) as f:
        assert f.read(10) == data[:10]
        f.seek(2 * MiB)
        assert f.read(1000) == data[2 * MiB : 2 * MiB + 1000]
        f.seek(-5, io.SEEK_END)
        assert f.read() == data[-5:] and f.read() == b""
        f.seek(0)
        assert f.read() == data


def test_missing_blob(backend: Backend) -> None:
    missing = dg.of_bytes(b"never stored")
    assert not backend.store.has(missing)
    for op in (
        lambda: backend.store.size(missing),
        lambda: backend.store.read(missing, 100),
        lambda: backend.store.open(missing),
    ):
        with pytest.raises(NotFound):
            op()
    backend.store.delete(missing)  # deleting what is not there is fine


def test_missing_blob_mtime(backend: Backend) -> None:
    with pytest.raises(NotFound):
        backend.store.mtime(dg.of_bytes(b"never stored"))


def test_delete(backend: Backend) -> None:
    keep = backend.store.put_bytes(b"keep")
    gone = backend.store.put_bytes(b"gone")
    backend.store.delete(gone)
    assert not backend.store.has(gone) and backend.store.has(keep)
    assert list(backend.store.digests()) == [keep]


def test_malformed_digests_are_refused(backend: Backend) -> None:
    for bad in ("sha256:xyz", "md5:" + "0" * 32, "sha256:../../etc/passwd"):
        with pytest.raises(InvalidInput):
            backend.store.has(bad)
        with pytest.raises(InvalidInput):
            backend.store.put_bytes(b"x", bad)
        with pytest.raises(InvalidInput):
            backend.store.read(bad, 10)


# -- S3 only ---------------------------------------------------------------------


def test_s3_check_says_what_to_do(moto_server: MotoServer) -> None:
    S3BlobStore(moto_server.client(), moto_server.new_bucket()).check()
    with pytest.raises(InvalidInput, match="does not exist: create it"):
        S3BlobStore(moto_server.client(), "no-such-bucket").check()
    dead = make_client(
        endpoint_url=f"http://127.0.0.1:{free_port()}", region="us-east-1", **MOTO_CREDENTIALS
    )
    with pytest.raises(InvalidInput, match="not reachable"):
        S3BlobStore(dead, "b").check()


def test_s3_layout_and_stray_objects(moto_server: MotoServer) -> None:
    client, bucket = moto_server.client(), moto_server.new_bucket()
    store = S3BlobStore(client, bucket, "/team/hub/")
    digest = store.put_bytes(b"laid out")
    assert store.key(digest) == f"team/hub/blobs/sha256/{dg.hex_part(digest)}"
    client.put_object(Bucket=bucket, Key="team/hub/blobs/sha256/not-a-digest", Body=b"x")
    client.put_object(Bucket=bucket, Key="elsewhere/blobs/sha256/" + "0" * 64, Body=b"x")
    assert list(store.digests()) == [digest]
