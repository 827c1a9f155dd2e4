"""Referrers: ``GET /v2/<name>/referrers/<digest>[?artifactType=…]`` → an OCI image index.

Lists the manifests in the repository whose ``subject`` is ``digest``; each
descriptor carries the artifact type (the manifest's ``artifactType``, else its
config media type) and annotations. An unknown subject yields an empty index, and so
does a repository the caller may pull from that does not exist yet (the spec: a registry
that supports the referrers API never answers it with 404); a repository the caller may
not see answers 401/404 as every route does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from litestar import Response
from sqlalchemy import select

from forkd.hub.models import Manifest
from forkd.hub.oci.common import Ctx, parse_digest
from forkd.pack import mediatypes as mt


async def list_referrers(ctx: Ctx, digest: str) -> Response[object]:
    await ctx.allow("pull")
    digest = parse_digest(digest)
    artifact_type = ctx.request.query_params.get("artifactType")
    repo = ctx.checked  # as read by allow; None: nothing pushed yet, so nothing refers
    rows: Sequence[Manifest] = []
    if repo is not None:
        query = (
            select(Manifest)
            .where(Manifest.repository_id == repo.id, Manifest.subject_digest == digest)
            .order_by(Manifest.created_at, Manifest.digest)
        )
        if artifact_type:
            query = query.where(Manifest.artifact_type == artifact_type)
        async with ctx.hub.db.reading() as session:
            rows = (await session.scalars(query)).all()
    descriptors: list[dict[str, Any]] = []
    for row in rows:
        desc: dict[str, Any] = {"mediaType": row.media_type, "digest": row.digest, "size": row.size}
        if row.artifact_type:
            desc["artifactType"] = row.artifact_type
        if row.annotations:
            desc["annotations"] = json.loads(row.annotations)
        descriptors.append(desc)
    headers = {"OCI-Filters-Applied": "artifactType"} if artifact_type else {}
    body = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": descriptors}
    return Response(body, status_code=200, headers=headers, media_type=mt.OCI_INDEX)
