"""The hub's work per request follows what was stored (issue 10 items 5 and 13):
server-side compaction of a pack declaring 1 TiB, map bounds at push, the tag page
built off the event loop, and compaction errors that reveal nothing about digests
outside the caller's repository.

Work is measured by bytes read (/proc/self/io: the hub runs in this process) and
ordering by a FIFO standing in for a blob file (a reader blocks in open() until the
test writes), never by timings. Timeouts are only safety nets.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from compaction_support import (  # noqa: F401  (s3_compaction_hub: a fixture)
    hub_blobs,
    on_backend,
    on_every_backend,
    s3_compaction_hub,
)
from hostile_packs import TIB, Layer, chunk, empty_tib, layer, sparse_tib_chain
from hub_support import TIMEOUT, HubServer, error_code, http

from forkd import digest as dg
from forkd.pack.imagemap import CHUNK_PAGES, MAX_MAP_BYTES, ChunkRef, ImageMap
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.store.blobs import FsBlobStore

SAFETY_NET = 120


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "rchar":
            return int(value)
    raise AssertionError("/proc/self/io has no rchar")


def upload(hub: HubServer, who: tuple[str, str], repo: str, tag: str, *layers: Layer) -> None:
    with RegistryClient(hub.target, Credential(*who)) as client:
        for item in layers:
            for digest, data in item.blobs.items():
                client.put_blob(repo, digest, len(data), lambda o, n, b=data: b[o : o + n])
            client.put_manifest(repo, tag if item is layers[-1] else item.digest, item.manifest)


def compact(hub: HubServer, who: tuple[str, str], repo: str, tag: str) -> httpx.Response:
    return http.post(
        f"{hub.url}/api/v1/compact/{repo}", json={"tag": tag, "to": f"{tag}-flat"}, auth=who
    )


def blob_path(hub: HubServer, digest: str) -> Path:
    return FsBlobStore(hub.data_dir / "blobs").path(digest)


@pytest.fixture
def hub(request: pytest.FixtureRequest, hub: HubServer) -> HubServer:
    """The session's filesystem hub, or (parametrized "s3") one whose blobs are in S3."""
    return on_backend(request, hub)


@pytest.mark.timeout(SAFETY_NET)
@on_every_backend
def test_compacting_a_1_tib_pack_on_the_hub_does_bounded_work(
    hub: HubServer, user: tuple[str, str]
) -> None:
    repo = f"{user[0]}/evil"
    upload(hub, user, repo, "empty", empty_tib(f"{repo}:empty"))
    upload(hub, user, repo, "sparse", *sparse_tib_chain(f"{repo}:sparse"))
    before = bytes_read()

    empty = compact(hub, user, repo, "empty")
    sparse = compact(hub, user, repo, "sparse")

    assert empty.status_code == 201, empty.text
    assert sparse.status_code == 201, sparse.text
    assert empty.json()["memory_size"] == TIB and sparse.json()["memory_size"] == TIB
    # The sparse chain's 515 written pages read back, a few small blobs for both: not the
    # 2 TiB of holes the two images declare.
    assert bytes_read() - before < 16 << 20
    assert not list(hub.data_dir.glob(".compact-*"))


def test_a_map_over_the_bound_is_refused_at_push(hub: HubServer, user: tuple[str, str]) -> None:
    repo = f"{user[0]}/big"
    imap = ImageMap("flat", 1 << 30, ())
    at_bound = layer(f"{repo}:ok", imap, map_bytes=padded(imap, MAX_MAP_BYTES))
    upload(hub, user, repo, "ok", at_bound)  # a map at the bound is a map

    over = layer(f"{repo}:big", imap, map_bytes=padded(imap, MAX_MAP_BYTES + 1))
    with RegistryClient(hub.target, Credential(*user)) as client:
        for digest, data in over.blobs.items():  # every blob is there: only the size is wrong
            client.put_blob(repo, digest, len(data), lambda o, n, b=data: b[o : o + n])
    r = http.put(
        f"{hub.url}/v2/{repo}/manifests/big",
        content=over.manifest,
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        auth=user,
    )
    assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID"
    detail = r.json()["errors"][0]["detail"]
    assert f"{MAX_MAP_BYTES + 1} bytes, over the pack format's limit of {MAX_MAP_BYTES}" in detail
    tags = http.get(f"{hub.url}/v2/{repo}/tags/list", auth=user).json()["tags"]
    assert tags == ["ok"]


def padded(imap: ImageMap, size: int) -> bytes:
    data = imap.to_bytes()
    return data + b" " * (size - len(data))


@on_every_backend
def test_compaction_answers_alike_for_a_layer_elsewhere_and_nowhere(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """A head whose parent is a private manifest of another repository, and one whose
    parent exists nowhere: the same status and text (the digest aside), no oracle."""
    victim = hub.add_user(f"{user[0]}-victim")
    secret = empty_tib(f"{victim[0]}/secret:v1")
    upload(hub, victim, f"{victim[0]}/secret", "v1", secret)
    nowhere = Layer(dg.of_bytes(b"no such manifest"), b"no such manifest")
    repo = f"{user[0]}/probe"
    answers = []
    for tag, parent in (("elsewhere", secret), ("nowhere", nowhere)):
        head = layer(f"{repo}:{tag}", ImageMap("diff", TIB, ()), parent=parent)
        upload(hub, user, repo, tag, head)
        r = compact(hub, user, repo, tag)
        answers.append((r.status_code, r.text.replace(parent.digest, "<parent>")))
    assert answers[0] == answers[1]
    status, text = answers[0]
    assert status == 400 and f"layer <parent> of the chain is not in {repo}" in text


@on_every_backend
def test_a_blob_the_hub_lost_is_a_logged_500_naming_no_digest(
    hub: HubServer, user: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    repo = f"{user[0]}/lost"
    base, diff = sparse_tib_chain(f"{repo}:v1")
    upload(hub, user, repo, "v1", base, diff)
    lost = next(d for d in diff.blobs if d not in (diff.digest,) and len(diff.blobs[d]) < 200)
    blobs = hub_blobs(hub)
    saved = blobs.read(lost, 200)
    blobs.delete(lost)
    try:
        with caplog.at_level(logging.ERROR, logger="forkd.hub.compaction"):
            r = compact(hub, user, repo, "v1")
    finally:
        blobs.put_bytes(saved, lost)
    assert r.status_code == 500
    assert "sha256:" not in r.text and "missing" not in r.text
    assert "the hub's fault" in r.json()["errors"][0]["detail"]
    assert any(lost in record.getMessage() for record in caplog.records)


def writer_once_read(fifo: Path) -> int:
    """A blocking write end of ``fifo``, once a reader has opened it: that reader then
    waits in read() until the test writes. (Opening fails while nobody reads.)"""
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            threading.Event().wait(0.01)  # poll for the reader; the safety net bounds it
            continue
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd


@pytest.mark.timeout(SAFETY_NET)
def test_the_tag_page_reads_a_map_at_the_bound_while_manifest_gets_go_on(
    hub: HubServer, user: tuple[str, str]
) -> None:
    repo = f"{user[0]}/page"
    imap = ImageMap("flat", TIB, ())
    data = padded(imap, MAX_MAP_BYTES)
    head = layer(f"{repo}:v1", imap, map_bytes=data)
    upload(hub, user, repo, "v1", head)
    hub.public(repo)
    path = blob_path(hub, dg.of_bytes(data))
    path.unlink()
    os.mkfifo(path)  # the page's read of the map blocks in open() until we write it
    page: dict[str, Any] = {}
    try:
        builder = threading.Thread(
            target=lambda: page.update(r=http.get(f"{hub.url}/{repo}/-/tags/v1")), daemon=True
        )
        builder.start()
        fd = writer_once_read(path)
        # The page is being built (its worker thread waits for the map): a manifest GET
        # is served meanwhile.
        r = http.get(
            f"{hub.url}/v2/{repo}/manifests/v1",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        assert r.status_code == 200 and r.content == head.manifest
        assert "r" not in page and builder.is_alive()
        with os.fdopen(fd, "wb") as fifo:
            fifo.write(data)
        builder.join(TIMEOUT)
    finally:
        path.unlink()
        path.write_bytes(data)
    assert page["r"].status_code == 200, page["r"].text
    assert "Not a forkd snapshot layer" not in page["r"].text


@pytest.mark.timeout(SAFETY_NET)
def test_concurrent_pages_parse_one_map_once(tmp_path: Path) -> None:
    """Two requests wanting the same layer's facts: one reads and parses its map, the
    other waits for the facts (a FIFO can be read once: a second read would hang)."""
    from forkd.hub.ui.queries import FactsCache

    blobs = FsBlobStore(tmp_path / "blobs")
    imap = ImageMap("flat", TIB, ())
    data = padded(imap, MAX_MAP_BYTES)
    head = layer("a/b:v1", imap, map_bytes=data)
    for digest, blob in head.blobs.items():
        blobs.put_bytes(blob, digest)
    blobs.put_bytes(head.manifest, head.digest)
    path = blobs.path(dg.of_bytes(data))
    path.unlink()
    os.mkfifo(path)
    hub = SimpleNamespace(blobs=blobs)
    cache = FactsCache()
    wanted = [(head.digest, len(head.manifest))]

    def feed() -> None:
        with os.fdopen(writer_once_read(path), "wb") as fifo:
            fifo.write(data)

    async def main() -> list[Any]:
        results: list[Any] = []

        async def one() -> None:
            results.append(await cache.many(hub, wanted, maps=True))  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
            await anyio.to_thread.run_sync(feed)
        return results

    first, second = anyio.run(main)
    facts = first[head.digest]
    assert facts is second[head.digest] and not facts.error
    assert facts.memory is not None and facts.memory.size == TIB


@on_every_backend
def test_compaction_refuses_a_chain_that_would_write_past_its_bound(
    hub: HubServer, user: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny blob that decompresses to 2 MiB, given to many regions: the hub's bound on
    what one compaction writes (MAX_WRITTEN, lowered here to keep the test small)."""
    from forkd.hub import compaction

    monkeypatch.setattr(compaction, "MAX_WRITTEN", 5 << 20)
    repo = f"{user[0]}/bomb"
    ref, blob = chunk([(0, CHUNK_PAGES)], 7)
    spread = tuple(
        ChunkRef(ref.digest, ref.blake3, ref.size, ref.stored, ((r * CHUNK_PAGES, CHUNK_PAGES),))
        for r in range(3)
    )
    upload(
        hub,
        user,
        repo,
        "v1",
        layer(f"{repo}:v1", ImageMap("flat", TIB, spread), {ref.digest: blob}),
    )
    r = compact(hub, user, repo, "v1")
    assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID"
    assert "would get 6291456 bytes written, over the limit of 5242880" in r.text
    assert not list(hub.data_dir.glob(".compact-*"))
