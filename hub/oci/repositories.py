"""Catalog: ``GET /v2/_catalog?n=&last=`` lists the repositories the caller may pull,
in lexical order, with ``Link`` pagination like the tags list."""

from __future__ import annotations

from urllib.parse import urlencode

from litestar import Response
from sqlalchemy import select

from forkd.hub import authz
from forkd.hub.auth import Caller, challenge
from forkd.hub.models import Repository
from forkd.hub.oci.common import HubRequest, page_after, page_size
from forkd.hub.services import Hub
from forkd.names import validate_name

MAX_PAGE = 1000


async def list_catalog(hub: Hub, request: HubRequest, caller: Caller) -> Response[object]:
    if caller.principal.anonymous and caller.grant is None:
        raise challenge(hub, request, "registry:catalog:*")
    params = request.query_params
    n = page_size(params.get("n"), MAX_PAGE)
    last = page_after(params.get("last"), validate_name, "repository name")
    async with hub.db.reading() as session:
        query = select(Repository.name).where(
            await session.run_sync(authz.visible, caller.principal)
        )
        if last:
            query = query.where(Repository.name > last)
        names = (
            list((await session.scalars(query.order_by(Repository.name).limit(n + 1))).all())
            if n
            else []
        )
    headers: dict[str, str] = {}
    if len(names) > n:
        names = names[:n]
        headers["Link"] = f'</v2/_catalog?{urlencode({"n": n, "last": names[-1]})}>; rel="next"'
    return Response({"repositories": names}, status_code=200, headers=headers)
