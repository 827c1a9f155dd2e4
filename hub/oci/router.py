"""The ``/v2/`` routes. Repository names contain slashes, so one catch-all handler parses
the path with the table below and calls the resource module's function."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Response, get, route
from litestar.di import NamedDependency
from litestar.params import FromPath

from forkd.errors import InvalidInput
from forkd.hub.auth import authenticate, challenge
from forkd.hub.errors import Code, RegistryError
from forkd.hub.oci import blobs, manifests, referrers, repositories, tags, uploads
from forkd.hub.oci.common import Ctx, HubRequest
from forkd.hub.services import Hub
from forkd.names import validate_name

Handler = Callable[..., Awaitable[Response[Any]]]
N = r"(?P<name>[^?#]+?)"
ROUTES: list[tuple[re.Pattern[str], dict[str, tuple[Handler, dict[str, Any]]]]] = [
    (
        re.compile(rf"^/{N}/manifests/(?P<reference>[^/]+)$"),
        {
            "GET": (manifests.get, {"head": False}),
            "HEAD": (manifests.get, {"head": True}),
            "PUT": (manifests.put, {}),
            "DELETE": (manifests.delete_manifest, {}),
        },
    ),
    (re.compile(rf"^/{N}/blobs/uploads/?$"), {"POST": (uploads.start, {})}),
    (
        re.compile(rf"^/{N}/blobs/uploads/(?P<upload_id>[^/]+)$"),
        {
            "GET": (uploads.status, {}),
            "PATCH": (uploads.patch, {}),
            "PUT": (uploads.put, {}),
            "DELETE": (uploads.cancel, {}),
        },
    ),
    (
        re.compile(rf"^/{N}/blobs/(?P<digest>[^/]+)$"),
        {
            "GET": (blobs.get, {"head": False}),
            "HEAD": (blobs.get, {"head": True}),
            "DELETE": (blobs.delete_blob, {}),
        },
    ),
    (re.compile(rf"^/{N}/tags/list$"), {"GET": (tags.list_tags, {})}),
    (re.compile(rf"^/{N}/referrers/(?P<digest>[^/]+)$"), {"GET": (referrers.list_referrers, {})}),
]


@get("/v2")
async def api_version(request: HubRequest, hub: NamedDependency[Hub]) -> Response[object]:
    """``GET /v2/``: 200 for any authenticated caller (a valid anonymous token too), else 401."""
    caller = await authenticate(hub, request)
    if caller.principal.anonymous and caller.grant is None:
        raise challenge(hub, request)
    return Response({}, headers={"Docker-Distribution-API-Version": "registry/2.0"})


@route(
    "/v2/{path:path}",
    http_method=["GET", "HEAD", "PUT", "PATCH", "POST", "DELETE"],
    request_max_body_size=None,
    include_in_schema=False,
)
async def dispatch(
    request: HubRequest, hub: NamedDependency[Hub], path: FromPath[str]
) -> Response[Any]:
    if path.rstrip("/") == "/_catalog":
        if request.method != "GET":
            raise RegistryError(Code.UNSUPPORTED, f"{request.method} not allowed here", status=405)
        response = await repositories.list_catalog(hub, request, await authenticate(hub, request))
        response.headers.setdefault("Docker-Distribution-API-Version", "registry/2.0")
        return response
    for pattern, methods in ROUTES:
        m = pattern.fullmatch(path)
        if m is None:
            continue
        params = m.groupdict()
        name = params.pop("name")
        try:
            validate_name(name)
        except InvalidInput as exc:
            raise RegistryError(Code.NAME_INVALID, str(exc)) from exc
        if request.method not in methods:
            raise RegistryError(Code.UNSUPPORTED, f"{request.method} not allowed here", status=405)
        handler, extra = methods[request.method]
        caller = await authenticate(hub, request)
        response = await handler(Ctx(hub, request, caller, name), **params, **extra)
        response.headers.setdefault("Docker-Distribution-API-Version", "registry/2.0")
        return response
    raise RegistryError(Code.NAME_UNKNOWN, f"no registry route for {path[:100]!r}", status=404)
