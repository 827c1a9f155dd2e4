"""The access-order document (docs/pack-format.md, "Access order"): chunks and memory
windows round-trip; a document without windows (an older writer) reads as none; an
untrusted document's windows are checked before anything uses them."""

from __future__ import annotations

import json

import pytest

from forkd import digest as dg
from forkd.errors import IntegrityError
from forkd.pack import accessorder as ao

HEAD = dg.of_bytes(b"manifest")
CHUNKS = [dg.of_bytes(bytes([i])) for i in range(3)]


def test_chunks_and_windows_round_trip() -> None:
    order = ao.Order(CHUNKS, [42, 7, 43])
    assert ao.decode(ao.encode(HEAD, order), HEAD, "order") == order


def test_an_order_without_windows_is_the_version_1_document_as_before() -> None:
    data = ao.encode(HEAD, ao.Order(CHUNKS))
    assert json.loads(data) == {"version": 1, "manifest": HEAD, "chunks": CHUNKS}
    assert ao.decode(data, HEAD, "order") == ao.Order(CHUNKS, [])


def test_repeated_windows_are_kept_once_in_first_order() -> None:
    doc = {"version": 1, "manifest": HEAD, "chunks": CHUNKS, "memory_windows": [5, 2, 5, 2]}
    assert ao.decode(json.dumps(doc).encode(), HEAD, "order").windows == [5, 2]


def test_repeated_chunks_are_kept_once_in_first_order() -> None:
    """A hostile order naming one chunk a million times: one entry (each reader, the
    fork command's fetch of the working set among them, sees each chunk once)."""
    chunks = [CHUNKS[1], CHUNKS[0]] + [CHUNKS[1]] * (ao.MAX_ORDER_CHUNKS - 2)
    doc = {"version": 1, "manifest": HEAD, "chunks": chunks}
    assert ao.decode(json.dumps(doc).encode(), HEAD, "order").chunks == CHUNKS[1::-1]


@pytest.mark.parametrize("windows", [
    -1, "3", None, {"0": 1}, [-1], [1.5], [True], ["3"], [ao.MAX_ORDER_WINDOWS], [2**63],
    list(range(ao.MAX_ORDER_WINDOWS + 1)),
])
def test_hostile_windows_are_refused(windows: object) -> None:
    doc = {"version": 1, "manifest": HEAD, "chunks": CHUNKS, "memory_windows": windows}
    with pytest.raises(IntegrityError, match="memory_windows"):
        ao.decode(json.dumps(doc).encode(), HEAD, "order")


def test_a_working_set_artifact_names_the_order_it_was_cut_from() -> None:
    from forkd.pack import mediatypes as mt
    from forkd.pack.manifest import Descriptor

    subject = Descriptor(mt.OCI_MANIFEST, HEAD, 100)
    order_digest = dg.of_bytes(ao.encode(HEAD, ao.Order(CHUNKS)))
    blob = Descriptor(ao.WORKING_SET, dg.of_bytes(b"chunks"), 6)
    manifest = ao.working_set_artifact(subject, order_digest, blob)
    layer = ao.working_set_layer(manifest, order_digest, "ws")
    assert (layer.digest, layer.size, layer.media_type) == (blob.digest, 6, ao.WORKING_SET)
    with pytest.raises(IntegrityError, match="another access order"):
        ao.working_set_layer(manifest, dg.of_bytes(b"a newer order"), "ws")
    with pytest.raises(IntegrityError, match="not a forkd working-set"):
        ao.working_set_layer(ao.artifact(subject, b"{}"), order_digest, "ws")


def test_working_set_chunks_are_the_first_of_the_order_that_fill_it_exactly() -> None:
    stored = {CHUNKS[0]: 10, CHUNKS[1]: 20, CHUNKS[2]: 30}
    assert ao.working_set_chunks(CHUNKS, stored, 30, "ws") == CHUNKS[:2]
    assert ao.working_set_chunks(CHUNKS + CHUNKS[:1], stored, 60, "ws") == CHUNKS
    assert ao.working_set_chunks(CHUNKS, stored, 0, "ws") == []
    for size in (25, 61):
        with pytest.raises(IntegrityError, match="do not add up"):
            ao.working_set_chunks(CHUNKS, stored, size, "ws")
    with pytest.raises(IntegrityError, match="not a chunk of the chain"):
        ao.working_set_chunks([dg.of_bytes(b"other"), *CHUNKS], stored, 30, "ws")
