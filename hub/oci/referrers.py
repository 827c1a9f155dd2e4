"""Referrers: ``GET /v2/<name>/referrers/<digest>[?artifactType=…]`` → an OCI image index.

Lists the manifests in the repository whose ``subject`` is ``digest``; each
descriptor carries the artifact type (the manifest's ``artifactType``, else its
config media type) and annotations. An unknown subject yields an empty index.
"""

from __future__ import annotations

import json
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
    async with ctx.hub.db.reading() as session:
        repo = await ctx.repository(session)
        query = (
            select(Manifest)
            .where(Manifest.repository_id == repo.id, Manifest.subject_digest == digest)
            .order_by(Manifest.created_at, Manifest.digest)
        )
        if artifact_type:
            query = query.where(Manifest.artifact_type == artifact_type)
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
