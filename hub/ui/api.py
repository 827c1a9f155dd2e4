"""Hub API ``/api/v1/readme/{name}``: read and set a repository's README and description.

``GET`` needs pull (public repositories: anyone; a repository that does not exist, or
that the caller may not see, is 404 ``{"status_code", "detail"}`` as elsewhere in
``/api/v1``); ``PUT`` needs push, with the same
credentials as ``/v2/`` (Basic, or a bearer token from ``/token`` whose scope grants
push on the repository: ``forkd push --readme`` reuses its push token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from litestar import Controller, get, put
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException, ValidationException
from litestar.params import FromPath, JSONBody

from forkd.bodies import Body
from forkd.errors import InvalidInput
from forkd.hub.auth import authenticate, authorize, client_ip
from forkd.hub.display import one_line
from forkd.hub.errors import Code, RegistryError
from forkd.hub.services import Hub
from forkd.hub.ui.common import HubRequest
from forkd.hub.ui.text import set_text
from forkd.names import validate_name

BODY_MAX = 512 * 1024


@dataclass
class RepositoryText:
    name: str
    description: str
    readme: str


class RepositoryTextUpdate(Body):
    readme: str | None = None
    description: str | None = None


def _name(raw: str) -> str:
    try:
        return validate_name(raw.strip("/"))
    except InvalidInput as exc:
        raise ValidationException(str(exc)) from exc


class ReadmeController(Controller):
    path = "/api/v1/readme"
    tags: ClassVar[list[str]] = ["catalog"]  # type: ignore[misc]

    @get("/{name:path}")
    async def get_text(
        self, request: HubRequest, hub: NamedDependency[Hub], name: FromPath[str]
    ) -> RepositoryText:
        """A repository's README (Markdown source) and description."""
        name = _name(name)
        caller = await authenticate(hub, request)
        not_found = NotFoundException(f"repository {name} not found")
        try:
            repo = await authorize(hub, request, caller, name, "pull")
        except RegistryError as exc:
            if exc.code is Code.NAME_UNKNOWN:
                raise not_found from None
            raise
        if repo is None:  # an admin may pull anything, but this does not exist
            raise not_found
        # The description is one line by contract: one stored before the check is shown
        # with its escapes visible (the README is Markdown prose, read as written).
        return RepositoryText(repo.name, one_line(repo.description), repo.readme)

    @put("/{name:path}", request_max_body_size=BODY_MAX)
    async def put_text(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        name: FromPath[str],
        data: JSONBody[RepositoryTextUpdate],
    ) -> RepositoryText:
        """Set the README and/or description (omitted or null fields are kept)."""
        name = _name(name)
        caller = await authenticate(hub, request)
        await authorize(hub, request, caller, name, "push")
        try:
            async with hub.db.transaction() as session:
                repo = await set_text(
                    session,
                    caller.principal,
                    name,
                    readme=data.readme,
                    description=data.description,
                )
                result = RepositoryText(repo.name, repo.description, repo.readme)
        except InvalidInput as exc:
            raise ValidationException(str(exc)) from exc
        hub.audit.record(caller.principal, client_ip(request), "repo.readme", name, "ok")
        return result
