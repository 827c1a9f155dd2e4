"""Tags: ``GET /v2/<name>/tags/list`` with ``n``/``last`` and ``Link`` pagination."""

from __future__ import annotations

from urllib.parse import urlencode

from litestar import Response
from sqlalchemy import select

from forkd.hub.models import Tag
from forkd.hub.oci.common import Ctx, page_after, page_size
from forkd.names import validate_tag

MAX_PAGE = 10_000


async def list_tags(ctx: Ctx) -> Response[object]:
    await ctx.allow("pull")
    params = ctx.request.query_params
    n = page_size(params.get("n"), MAX_PAGE)
    last = page_after(params.get("last"), validate_tag, "tag name")
    async with ctx.hub.db.reading() as session:
        repo = await ctx.repository(session)
        query = select(Tag.name).where(Tag.repository_id == repo.id).order_by(Tag.name)
        if last:
            query = query.where(Tag.name > last)
        names = list((await session.scalars(query.limit(n + 1))).all()) if n else []
    headers: dict[str, str] = {}
    if len(names) > n:
        names = names[:n]
        query_string = urlencode({"n": n, "last": names[-1]})
        headers["Link"] = f'<{ctx.url("tags/list")}?{query_string}>; rel="next"'
    return Response({"name": ctx.name, "tags": names}, status_code=200, headers=headers)
