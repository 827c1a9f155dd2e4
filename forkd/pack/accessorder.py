"""The access order of a snapshot: the chunks its children needed first, in order (what a
lazy fork prefetches first; docs/pack-format.md, "Access order").

It travels as an optional OCI artifact next to the pack, never inside it: a manifest of
``artifactType`` ``ACCESS_ORDER_ARTIFACT`` whose ``subject`` is the snapshot's manifest,
with the OCI empty config and one layer, the order document (``ACCESS_ORDER``, JSON)::

    {"version": 1, "manifest": "sha256:<snapshot manifest>", "chunks": ["sha256:…", …]}

The snapshot's own manifest and digest are unchanged, so a reader that knows nothing of
it (any older forkd) pulls and forks the pack as before; a registry lists it through the
referrers API of the snapshot's digest (filtered by the artifact type).
"""

from __future__ import annotations

import json

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


def encode(head: str, chunks: list[str]) -> bytes:
    """The order document of snapshot manifest ``head``."""
    doc = {"version": ORDER_VERSION, "manifest": dg.validate(head),
           "chunks": [dg.validate(c) for c in chunks[:MAX_ORDER_CHUNKS]]}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes, head: str, what: str) -> list[str]:
    """The chunk digests of an untrusted order document recorded for ``head``."""
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
        return [dg.validate(c) for c in chunks]
    except Exception as exc:
        raise IntegrityError(f"{what}: {exc}") from exc


def artifact(head: Descriptor, order: bytes) -> bytes:
    """The referrer manifest carrying ``order`` for the snapshot manifest ``head``."""
    doc = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": ACCESS_ORDER_ARTIFACT,
        "config": {"mediaType": OCI_EMPTY, "digest": dg.of_bytes(EMPTY_CONFIG), "size": 2},
        "layers": [{"mediaType": ACCESS_ORDER, "digest": dg.of_bytes(order),
                    "size": len(order)}],
        "subject": head.to_json(),
    }
    return json.dumps(doc, indent=2).encode()


def order_layer(data: bytes, what: str) -> Descriptor:
    """The order blob's descriptor of an untrusted referrer manifest."""
    raw = jsondoc.loads(data, what)
    if not isinstance(raw, dict) or raw.get("artifactType") != ACCESS_ORDER_ARTIFACT:
        raise IntegrityError(f"{what}: not a forkd access-order artifact")
    layers = raw.get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        raise IntegrityError(f"{what}: an access-order artifact has exactly one layer")
    d = Descriptor.from_json(layers[0], f"{what} layer")
    if d.media_type != ACCESS_ORDER or d.size > MAX_ORDER_BYTES:
        raise IntegrityError(f"{what}: its layer is not an access order of at most "
                             f"{MAX_ORDER_BYTES} bytes")
    return d
