"""Hostile review 10: what one view of a pack costs does not grow with the rows a pusher
adds to its repository.

Before: the pack page, every tag page and the lineage API loaded every manifest row and
every tag row of the repository on each view, and the catalog API's repository detail
every manifest's digest and subject: a pusher's hundred thousand untagged referrers (each
one PUT) or tags made each signed-out view of a public pack read them all. Now a view reads
the tags it lists, their chains, at most ``MAX_CHAIN`` descendants and ``TAG_NAMES_MAX``
tag names per manifest (hub/chains.py).

Measured in this process (the hub runs in it): the Manifest and Tag rows each view loads,
and the peak of its Python allocations against the same view of the repository before the
rows were added.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hub_support import OCI_MANIFEST, HubServer, artifact
from sqlalchemy import event

from forkd.hub.chains import MAX_CHAIN, TAG_NAMES_MAX
from forkd.hub.models import Manifest, Tag
from forkd.hub.ui.queries import TAGS_PER_PAGE

ROWS = 20_000  # referrers, unrelated manifests and tags the pusher adds (each)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@contextmanager
def _loads() -> Iterator[dict[str, int]]:
    """Manifest and Tag rows the ORM loads meanwhile (any session of this process)."""
    counts = {"manifests": 0, "tags": 0}

    def on_manifest(*_: Any) -> None:
        counts["manifests"] += 1

    def on_tag(*_: Any) -> None:
        counts["tags"] += 1

    event.listen(Manifest, "load", on_manifest)
    event.listen(Tag, "load", on_tag)
    try:
        yield counts
    finally:
        event.remove(Manifest, "load", on_manifest)
        event.remove(Tag, "load", on_tag)


def _peak(get: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        get()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _add_rows(hub: HubServer, repo: str, base: str) -> None:
    """What a pusher's PUTs would leave, written straight to the hub's database (pushing
    60,000 manifests through the API would take minutes): ``ROWS`` untagged referrers of
    ``base``, ``ROWS`` manifests of nobody's chain and ``ROWS`` tags on ``base``."""
    now = "2026-12-03 00:00:00.000000+00:00"
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        (repo_id,) = db.execute("SELECT id FROM repositories WHERE name = ?", (repo,)).fetchone()
        digests = [_digest(f"{repo} row {i}".encode()) for i in range(2 * ROWS)]
        db.executemany(
            "INSERT INTO blobs (digest, size, created_at) VALUES (?, 100, ?)",
            [(d, now) for d in digests],
        )
        db.executemany(
            "INSERT INTO manifests (repository_id, digest, media_type, subject_digest, size,"
            " created_at) VALUES (?, ?, ?, ?, 100, ?)",
            [
                (repo_id, d, OCI_MANIFEST, base if i < ROWS else None, now)
                for i, d in enumerate(digests)
            ],
        )
        db.executemany(
            "INSERT INTO tags (repository_id, name, manifest_digest, updated_at, pull_count)"
            " VALUES (?, ?, ?, ?, 0)",
            [(repo_id, f"zz{i:05d}", base, now) for i in range(ROWS)],
        )


def test_a_views_reads_do_not_grow_with_the_repositorys_rows(hub: HubServer) -> None:
    alice = hub.add_user(f"alice{time.monotonic_ns() % 10**9}")
    repo = f"{alice[0]}/crowded"
    with hub.client(alice) as c:

        def put(tag: str, subject: dict[str, object] | None = None) -> dict[str, object]:
            digest, body = artifact(c, repo, f"layer of {tag}".encode(), tag=tag, subject=subject)
            return {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body)}

        base = put("base")
        mid = put("mid", base)
        put("latest", mid)
    hub.public(repo)
    views = [
        f"/{repo}",
        f"/{repo}/-/tags/base",
        f"/{repo}/-/tags/latest",
        f"/api/v1/lineage/{repo}?tag=base",
        f"/api/v1/lineage/{repo}?tag=latest",
        f"/api/v1/repositories/{repo}",
    ]
    with hub.client() as anonymous:

        def view(path: str) -> Any:
            r = anonymous.get(path)
            assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}"
            return r

        for path in views:
            view(path)  # warm: caches, templates
        before = {path: _peak(lambda path=path: view(path)) for path in views}
        _add_rows(hub, repo, str(base["digest"]))
        for path in views:
            view(path)
        for path in views:
            with _loads() as loaded:
                peak = _peak(lambda path=path: view(path))
            # The shown tags, the chains, the descendants: not the 60,000 rows.
            assert loaded["manifests"] <= 2 * MAX_CHAIN + TAGS_PER_PAGE + 8, (path, loaded)
            assert loaded["tags"] <= TAGS_PER_PAGE + 2, (path, loaded)
            assert peak < before[path] + (4 << 20), (path, before[path] >> 10, peak >> 10)

        # What the views say is still right, within their bounds.
        page = view(f"/{repo}").text
        assert f"{ROWS + 3} tags" in page
        assert len(re.findall(rf'href="/{repo}/-/tags/([a-z0-9]+)"', page)) >= TAGS_PER_PAGE
        lineage = view(f"/api/v1/lineage/{repo}?tag=base").json()
        assert len(lineage["descendants"]) == MAX_CHAIN
        assert {d["parent"] for d in lineage["descendants"]} == {base["digest"]}
        assert len(lineage["head"]["tags"]) == TAG_NAMES_MAX
        assert lineage["head"]["tags"][0] == "base"
        up = view(f"/api/v1/lineage/{repo}?tag=latest").json()
        assert [a["digest"] for a in up["ancestors"]] == [mid["digest"], base["digest"]]
        assert up["ancestors"][0]["tags"] == ["mid"]
        detail = view(f"/api/v1/repositories/{repo}").json()
        assert detail["tags_total"] == ROWS + 3
        depth = {t["name"]: t["chain_depth"] for t in detail["tags"]}
        assert depth["base"] == 0 and depth["latest"] == 2 and depth["mid"] == 1
        tag_page = view(f"/{repo}/-/tags/latest").text
        assert f"{repo}:latest" in tag_page
