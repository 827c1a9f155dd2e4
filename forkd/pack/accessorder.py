"""The access order of a snapshot: the chunks its children needed first, in order (what a
lazy fork prefetches first; docs/pack-format.md, "Access order").

It travels as an optional OCI artifact next to the pack, never inside it: a manifest of
``artifactType`` ``ACCESS_ORDER_ARTIFACT`` whose ``subject`` is the snapshot's manifest,
with the OCI empty config and one layer, the order document (``ACCESS_ORDER``, JSON)::

    {"version": 1, "manifest": "sha256:<snapshot manifest>", "chunks": ["sha256:…", …],
     "memory_windows": [42, 43, …]}

``memory_windows`` (optional; an older reader ignores it): the ``WINDOW_BYTES``-aligned
windows of the memory image that children read first, by index, in order. A lazy server
puts their holes (pages no layer provides: zeros) into the page cache as it starts, so
the children's first touches of free memory there cost no read.

A publisher may add the **working set**: a second artifact (``WORKING_SET_ARTIFACT``, same
``subject``) whose one layer (``WORKING_SET``) is the stored (compressed) bytes of the
order's first chunks (``MAX_WORKING_SET_BYTES`` of them at most: a reader refuses a larger
blob before a byte of it travels), concatenated in the order's order, and whose annotation
``ORDER_ANNOTATION`` names the order blob it was cut from. A lazy server fetches it in
one request instead of a request per chunk, and checks each chunk in it against the
digest its map names before using it (``working_set_chunks`` says where each one is).

The snapshot's own manifest and digest are unchanged, so a reader that knows nothing of
it (any older forkd) pulls and forks the pack as before; a registry lists it through the
referrers API of the snapshot's digest (filtered by the artifact type).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError
from forkd.pack import mediatypes as mt
from forkd.pack.manifest import Descriptor

ACCESS_ORDER_ARTIFACT = "application/vnd.forkd.access-order.v1"
ACCESS_ORDER = "application/vnd.forkd.access-order.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG = b"{}"
ORDER_VERSION = 1
MAX_ORDER_CHUNKS = 1 << 20  # names each chunk of a chain once at most
MAX_ORDER_BYTES = 80 * MAX_ORDER_CHUNKS  # a quoted sha256 digest and a comma each
WINDOW_BYTES = 2 << 20  # the memory image's windows that memory_windows names
MAX_ORDER_WINDOWS = 1 << 19  # a 1 TiB memory image's windows


# the working set's bytes a publisher puts in its blob, and a reader accepts in one: a
# guest touching all its memory before its first answer (or a hostile publisher, or hub)
# would otherwise have every lazy fork stream (and spool to disk) the whole image, or
# whatever size the artifact declares, before anything else
MAX_WORKING_SET_BYTES = 256 << 20

WORKING_SET_ARTIFACT = "application/vnd.forkd.working-set.v1"
WORKING_SET = "application/vnd.forkd.working-set.chunks.v1"
ORDER_ANNOTATION = "vnd.forkd.access-order"  # the working set's order blob digest


@dataclass(frozen=True)
class Order:
    """An access order: chunk digests, and memory-image windows (indexes), each in the
    order children first needed them; ``working_set``: where a hub keeps the first of
    those chunks in one blob (its artifact, not part of the order document)."""

    chunks: list[str]
    windows: list[int] = field(default_factory=list)
    working_set: Descriptor | None = None


def encode(head: str, order: Order) -> bytes:
    """The order document of snapshot manifest ``head``."""
    doc: dict[str, object] = {"version": ORDER_VERSION, "manifest": dg.validate(head),
                              "chunks": [dg.validate(c) for c in order.chunks[:MAX_ORDER_CHUNKS]]}
    if order.windows:
        doc["memory_windows"] = order.windows[:MAX_ORDER_WINDOWS]
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes, head: str, what: str) -> Order:
    """The order an untrusted document recorded for ``head``: its chunk digests (each
    once, in first order: a document repeating one a million times is one entry; any may
    not be the chain's: a reader ignores those) and memory windows (non-negative
    indexes, each once; a reader ignores those past its image)."""
    if len(data) > MAX_ORDER_BYTES:
        raise IntegrityError(f"{what} is {len(data)} bytes, over {MAX_ORDER_BYTES}")
    raw = jsondoc.loads(data, what)
    if not isinstance(raw, dict) or raw.get("version") != ORDER_VERSION:
        raise IntegrityError(f"{what}: not an access order of version {ORDER_VERSION}")
    if raw.get("manifest") != head:
        raise IntegrityError(f"{what}: recorded for {str(raw.get('manifest'))[:80]!r}, "
                             f"not {head}")
    chunks = raw.get("chunks")
    if not isinstance(chunks, list) or len(chunks) > MAX_ORDER_CHUNKS:
        raise IntegrityError(f"{what}: chunks must be a list of at most {MAX_ORDER_CHUNKS}")
    try:
        digests = list(dict.fromkeys(dg.validate(c) for c in chunks))  # each once
    except Exception as exc:
        raise IntegrityError(f"{what}: {exc}") from exc
    windows = raw.get("memory_windows", [])
    if (not isinstance(windows, list) or len(windows) > MAX_ORDER_WINDOWS
            or not all(type(w) is int and 0 <= w < MAX_ORDER_WINDOWS for w in windows)):
        raise IntegrityError(f"{what}: memory_windows must be a list of at most "
                             f"{MAX_ORDER_WINDOWS} window indexes in [0, {MAX_ORDER_WINDOWS})")
    return Order(digests, list(dict.fromkeys(windows)))


def artifact(head: Descriptor, order: bytes) -> bytes:
    """The referrer manifest carrying ``order`` for the snapshot manifest ``head``."""
    return _referrer(ACCESS_ORDER_ARTIFACT, head,
                     Descriptor(ACCESS_ORDER, dg.of_bytes(order), len(order)))


def order_layer(data: bytes, what: str) -> Descriptor:
    """The order blob's descriptor of an untrusted referrer manifest."""
    d = _one_layer(data, ACCESS_ORDER_ARTIFACT, "an access-order", what)
    if d.media_type != ACCESS_ORDER or d.size > MAX_ORDER_BYTES:
        raise IntegrityError(f"{what}: its layer is not an access order of at most "
                             f"{MAX_ORDER_BYTES} bytes")
    return d


def working_set_artifact(head: Descriptor, order_digest: str, blob: Descriptor) -> bytes:
    """The referrer manifest of ``head`` carrying the working-set blob cut from the order
    blob ``order_digest``."""
    return _referrer(WORKING_SET_ARTIFACT, head,
                     Descriptor(WORKING_SET, blob.digest, blob.size,
                                {ORDER_ANNOTATION: dg.validate(order_digest)}))


def working_set_layer(data: bytes, order_digest: str, what: str) -> Descriptor:
    """The working-set blob's descriptor of an untrusted referrer manifest, when it was
    cut from the order blob ``order_digest`` (else IntegrityError)."""
    d = _one_layer(data, WORKING_SET_ARTIFACT, "a working-set", what)
    if d.media_type != WORKING_SET:
        raise IntegrityError(f"{what}: its layer is not a working set ({WORKING_SET})")
    if d.size > MAX_WORKING_SET_BYTES:  # before a byte of it is spooled or streamed
        raise IntegrityError(f"{what}: {d.size} bytes, over {MAX_WORKING_SET_BYTES}")
    if d.annotations.get(ORDER_ANNOTATION) != order_digest:
        raise IntegrityError(f"{what}: cut from another access order, not {order_digest}")
    return d


def _referrer(artifact_type: str, subject: Descriptor, layer: Descriptor) -> bytes:
    """An OCI artifact manifest of ``artifact_type``: the empty config, one layer."""
    doc = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": {"mediaType": OCI_EMPTY, "digest": dg.of_bytes(EMPTY_CONFIG), "size": 2},
        "layers": [layer.to_json()],
        "subject": subject.to_json(),
    }
    return json.dumps(doc, indent=2).encode()


def _one_layer(data: bytes, artifact_type: str, kind: str, what: str) -> Descriptor:
    """The one layer of an untrusted artifact manifest of ``artifact_type``."""
    raw = jsondoc.loads(data, what)
    if not isinstance(raw, dict) or raw.get("artifactType") != artifact_type:
        raise IntegrityError(f"{what}: not a forkd {kind.split(' ', 1)[1]} artifact")
    layers = raw.get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        raise IntegrityError(f"{what}: {kind} artifact has exactly one layer")
    return Descriptor.from_json(layers[0], f"{what} layer")


def bounded_prefix(chunks: list[str], stored: Callable[[str], int],
                   limit: int | None = None) -> list[str]:
    """The first of ``chunks`` whose stored sizes add up to ``limit`` (default
    ``MAX_WORKING_SET_BYTES``) at most: what a publisher puts in a working set."""
    limit = MAX_WORKING_SET_BYTES if limit is None else limit
    out: list[str] = []
    total = 0
    for digest in chunks:
        total += stored(digest)
        if total > limit:
            break
        out.append(digest)
    return out


def working_set_chunks(chunks: list[str], stored: dict[str, int], size: int,
                       what: str) -> list[str]:
    """The chunks a working-set blob of ``size`` bytes holds: the first of ``chunks`` whose
    stored sizes (``stored``: the chain's chunks, from its maps) add up to exactly
    ``size``. IntegrityError when they do not, or one is not a chunk of the chain."""
    held: list[str] = []
    total = 0
    for digest in dict.fromkeys(chunks):
        if total == size:
            break
        if digest not in stored:
            raise IntegrityError(f"{what}: names {digest}, not a chunk of the chain")
        held.append(digest)
        total += stored[digest]
    if total != size:
        raise IntegrityError(f"{what} is {size} bytes; the order's chunks do not add up to "
                             "that")
    return held
