"""Hostile review 24: rows a pusher adds that nothing counted.

1. Untagged manifests (the leftover rounds 10 and 14 named): a manifest pushed by digest
   needs no tag, so ``tags_max`` does not count it, and without a quota on the namespace
   it costs nothing: one push member PUT small manifests (each a new digest: change an
   annotation) without end, rows in ``manifests`` and ``manifest_references`` and files
   in the blob store. Now a repository holds at most ``manifests_max`` manifests, tagged
   or not, counted under the repository's lock (new manifests racing for the last place
   do not pass together); past it a new one is 403 DENIED saying what to do, while
   pushing one the repository holds (to tag it) and pushing after a deletion still work.
   A server-side compaction registers its manifest through the same check.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hub_support import (
    ADMIN,
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    artifact,
    error_code,
    push_blob,
    sha,
)


def _manifest(config: str, note: str) -> bytes:
    """A small manifest with no layers, made new by its annotation."""
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.note",
        "config": {"mediaType": EMPTY_MEDIA, "digest": config, "size": 2},
        "layers": [],
        "annotations": {"note": note},
    }
    return json.dumps(doc).encode()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_untagged_manifests_per_repository_are_bounded(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    """Before: ``manifests_max`` did not exist; five untagged manifests in a repository of a
    hub set to hold three were all 201 (any number were). Now the fourth is 403."""
    settings: dict[str, Any] = {"manifests_max": 3}
    if backend == "postgresql":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    server = HubServer(tmp_path / "hub", settings).start()
    try:
        repo = f"{ADMIN[0]}/notes"
        put = {"headers": {"Content-Type": OCI_MANIFEST}}
        with server.client(ADMIN) as c:
            config = push_blob(c, repo, EMPTY_CONFIG)
            first = _manifest(config, "0")
            r = c.put(f"/v2/{repo}/manifests/{sha(first)}", content=first, **put)
            assert r.status_code == 201, r.text

        def push(note: str) -> int:
            body = _manifest(config, note)
            with server.client(ADMIN) as c:
                return c.put(f"/v2/{repo}/manifests/{sha(body)}", content=body, **put).status_code

        with ThreadPoolExecutor(4) as pool:  # two places left, four racing for them
            assert sorted(pool.map(push, ["r0", "r1", "r2", "r3"])) == [201, 201, 403, 403]
        with server.client(ADMIN) as c:
            body = _manifest(config, "one more")
            r = c.put(f"/v2/{repo}/manifests/{sha(body)}", content=body, **put)
            assert r.status_code == 403 and error_code(r) == "DENIED", r.text
            assert "manifests_max" in r.text and "delete" in r.text.lower()
            r = c.put(f"/v2/{repo}/manifests/latest", content=body, **put)  # by tag: a new one
            assert r.status_code == 403 and error_code(r) == "DENIED", r.text
            # One the repository holds: tagging it, or pushing it again, works.
            assert c.put(f"/v2/{repo}/manifests/v1", content=first, **put).status_code == 201
            r = c.put(f"/v2/{repo}/manifests/{sha(first)}", content=first, **put)
            assert r.status_code == 201, r.text
            # Another repository of the namespace has its own count.
            artifact(c, f"{ADMIN[0]}/other", b"layer", tag="t")
            # A deletion makes a place.
            r = c.delete(f"/v2/{repo}/manifests/{sha(first)}")
            assert r.status_code == 202, r.text
            r = c.put(f"/v2/{repo}/manifests/{sha(body)}", content=body, **put)
            assert r.status_code == 201, r.text
    finally:
        server.stop()
