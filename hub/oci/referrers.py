"""Referrers: ``GET /v2/<name>/referrers/<digest>[?artifactType=…]`` → an OCI image index.

Lists the manifests in the repository whose ``subject`` is ``digest``; each
descriptor carries the artifact type (the manifest's ``artifactType``, else its
config media type) and annotations. An unknown subject yields an empty index, and so
does a repository the caller may pull from that does not exist yet (the spec: a registry
that supports the referrers API never answers it with 404); a repository the caller may
not see answers 401/404 as every route does.

The index comes in pages (the spec's ``Link: <…>; rel="next"``), by digest: at most
``PAGE`` descriptors and, past the first, ``PAGE_BYTES`` of annotations text, so a
subject with many referrers carrying large annotations (each up to a manifest's size)
cannot make one request build gigabytes. ``last=<digest>`` continues after that digest.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from litestar import Response
from sqlalchemy import Select, func, select

from forkd.hub.models import Manifest
from forkd.hub.oci.common import Ctx, in_chunks, parse_digest
from forkd.pack import mediatypes as mt

PAGE = 1000  # descriptors per page
PAGE_BYTES = 4 << 20  # annotations text per page (a page holds at least one descriptor)


def referrers_query(
    repository_id: int, subject: str, artifact_type: str | None, last: str | None
) -> Select[str, str, int, str | None, Any]:
    """One page's rows (one more than ``PAGE``): the repository's manifests whose subject
    is ``subject``, by digest after ``last``; read through the repository's own index
    ``(repository_id, subject_digest, digest)`` (migration 0014)."""
    query = (
        select(
            Manifest.digest,
            Manifest.media_type,
            Manifest.size,
            Manifest.artifact_type,
            func.coalesce(func.length(Manifest.annotations), 0),
        )
        .where(Manifest.repository_id == repository_id, Manifest.subject_digest == subject)
        .order_by(Manifest.digest)
        .limit(PAGE + 1)
    )
    if artifact_type:
        query = query.where(Manifest.artifact_type == artifact_type)
    if last:
        query = query.where(Manifest.digest > last)
    return query


async def list_referrers(ctx: Ctx, digest: str) -> Response[object]:
    await ctx.allow("pull")
    digest = parse_digest(digest)
    params = ctx.request.query_params
    artifact_type = params.get("artifactType")
    last = params.get("last")
    if last is not None:
        last = parse_digest(last)
    repo = ctx.checked  # as read by allow; None: nothing pushed yet, so nothing refers
    descriptors: list[dict[str, Any]] = []
    more = False
    if repo is not None:
        query = referrers_query(repo.id, digest, artifact_type, last)
        async with ctx.hub.db.reading() as session:
            rows = (await session.execute(query)).all()
            taken: list[Any] = []
            used = 0
            for row in rows:
                if len(taken) == PAGE or (taken and used + row[4] > PAGE_BYTES):
                    more = True
                    break
                taken.append(row)
                used += row[4]
            annotated = [row[0] for row in taken if row[4]]
            notes: dict[str, str] = {}
            for chunk in in_chunks(annotated):
                found = await session.execute(
                    select(Manifest.digest, Manifest.annotations).where(
                        Manifest.repository_id == repo.id, Manifest.digest.in_(chunk)
                    )
                )
                notes.update({d: a for d, a in found if a})
        for row_digest, media_type, size, row_type, _ in taken:
            desc: dict[str, Any] = {"mediaType": media_type, "digest": row_digest, "size": size}
            if row_type:
                desc["artifactType"] = row_type
            if row_digest in notes:
                desc["annotations"] = json.loads(notes[row_digest])
            descriptors.append(desc)
    headers = {"OCI-Filters-Applied": "artifactType"} if artifact_type else {}
    if more:
        following = {"last": descriptors[-1]["digest"]}
        if artifact_type:
            following["artifactType"] = artifact_type
        headers["Link"] = f'<{ctx.url(f"referrers/{digest}")}?{urlencode(following)}>; rel="next"'
    body = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": descriptors}
    return Response(body, status_code=200, headers=headers, media_type=mt.OCI_INDEX)
