"""Hub API: organisations' members and teams, namespaces' storage quotas.

- ``GET /api/v1/orgs/<org>/members``: direct members (any member of the org or a site admin).
- ``GET /api/v1/orgs/<org>/teams``: teams with role, repository glob and members (same).
- ``POST /api/v1/orgs/<org>/teams`` ``{"name", "role", "repositories"?, "members"?}``,
  ``DELETE /api/v1/orgs/<org>/teams/<team>``,
  ``PUT``/``DELETE /api/v1/orgs/<org>/teams/<team>/members/<user>``: org admins only
  (an admin role on the organisation as a whole, direct or through a team without a glob)
  and site admins.
- ``GET /api/v1/namespaces/<ns>/quota``: ``{namespace, quota_bytes, used_bytes}`` (members
  and site admins); ``PUT`` ``{"quota_bytes": N | null}``: site admins only.

Anonymous callers get 401; callers without the needed role 403; an API token narrows as
everywhere (its scope on the organisation must reach the role).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from litestar import Controller, Request, delete, get, post, put
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.exceptions import (
    NotAuthorizedException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.params import FromPath, JSONBody

from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts, quotas
from forkd.hub.auth import authenticate, client_ip
from forkd.hub.models import ROLES
from forkd.hub.services import Hub
from forkd.hub.tokens_api import _user

HubRequest = Request[object, object, State]


@dataclass
class MemberInfo:
    user: str
    role: str
    robot: bool


@dataclass
class TeamInfo:
    name: str
    role: str
    repositories: str  # glob on full repository names; "" = all of the org's repositories
    members: list[str]
    created_at: datetime


@dataclass
class TeamCreate:
    name: str
    role: str
    repositories: str = ""
    members: list[str] = field(default_factory=list)


@dataclass
class QuotaInfo:
    namespace: str
    quota_bytes: int | None
    used_bytes: int


@dataclass
class QuotaSet:
    quota_bytes: int | None


async def _require(hub: Hub, request: HubRequest, namespace: str, role: str) -> str:
    """The caller's name, if they hold ``role`` on ``namespace`` as a whole; else 401/403."""
    principal = await _user(hub, request)
    held = await hub.db.read(accounts.namespace_role, principal, namespace)
    if held is None or ROLES.index(held) < ROLES.index(role):
        hub.audit.record(principal.name, client_ip(request), f"org.{role}", namespace, "denied")
        raise PermissionDeniedException(f"needs the {role} role on {namespace!r}")
    return principal.name


def _bad(exc: InvalidInput | Conflict) -> Exception:
    if isinstance(exc, Conflict):
        from litestar.exceptions import HTTPException

        return HTTPException(status_code=409, detail=str(exc))
    return ValidationException(str(exc))


class OrgController(Controller):
    path = "/api/v1/orgs"

    @get("/{org:str}/members")
    async def list_members(
        self, request: HubRequest, hub: NamedDependency[Hub], org: FromPath[str]
    ) -> list[MemberInfo]:
        await _require(hub, request, org, "pull")
        try:
            async with hub.db.reading() as session:
                rows = await accounts.list_members(session, org)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        return [MemberInfo(n, r, robot) for n, r, robot in rows]

    @get("/{org:str}/teams")
    async def list_teams(
        self, request: HubRequest, hub: NamedDependency[Hub], org: FromPath[str]
    ) -> list[TeamInfo]:
        await _require(hub, request, org, "pull")
        try:
            async with hub.db.reading() as session:
                rows = await accounts.list_teams(session, org)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        return [TeamInfo(t.name, t.role, t.repositories, m, t.created_at) for t, m in rows]

    @post("/{org:str}/teams")
    async def create_team(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        data: JSONBody[TeamCreate],
    ) -> TeamInfo:
        actor = await _require(hub, request, org, "admin")
        try:
            async with hub.db.transaction() as session:
                team = await accounts.create_team(
                    session,
                    org,
                    data.name,
                    data.role,
                    repositories=data.repositories,
                    members=data.members,
                )
                info = TeamInfo(
                    team.name,
                    team.role,
                    team.repositories,
                    sorted(set(data.members)),
                    team.created_at,
                )
        except (InvalidInput, Conflict) as exc:
            raise _bad(exc) from exc
        hub.audit.record(
            actor,
            client_ip(request),
            "team.create",
            f"{org}/{data.name}",
            "ok",
            role=data.role,
            repositories=data.repositories,
            members=info.members,
        )
        return info

    @delete("/{org:str}/teams/{team:str}")
    async def delete_team(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        team: FromPath[str],
    ) -> None:
        actor = await _require(hub, request, org, "admin")
        try:
            async with hub.db.transaction() as session:
                await accounts.delete_team(session, org, team)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        hub.audit.record(actor, client_ip(request), "team.delete", f"{org}/{team}", "ok")

    @put("/{org:str}/teams/{team:str}/members/{username:str}", status_code=204)
    async def add_member(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        team: FromPath[str],
        username: FromPath[str],
    ) -> None:
        actor = await _require(hub, request, org, "admin")
        try:
            async with hub.db.transaction() as session:
                await accounts.add_team_member(session, org, team, username)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        hub.audit.record(
            actor, client_ip(request), "team.member.add", f"{org}/{team}", "ok", user=username
        )

    @delete("/{org:str}/teams/{team:str}/members/{username:str}")
    async def remove_member(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        team: FromPath[str],
        username: FromPath[str],
    ) -> None:
        actor = await _require(hub, request, org, "admin")
        try:
            async with hub.db.transaction() as session:
                await accounts.remove_team_member(session, org, team, username)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        hub.audit.record(
            actor, client_ip(request), "team.member.remove", f"{org}/{team}", "ok", user=username
        )


class QuotaController(Controller):
    path = "/api/v1/namespaces"

    @get("/{namespace:str}/quota")
    async def get_quota(
        self, request: HubRequest, hub: NamedDependency[Hub], namespace: FromPath[str]
    ) -> QuotaInfo:
        await _require(hub, request, namespace, "pull")
        try:
            async with hub.db.reading() as session:
                quota, used = await quotas.show(session, namespace)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        return QuotaInfo(namespace, quota, used)

    @put("/{namespace:str}/quota")
    async def set_quota(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        namespace: FromPath[str],
        data: JSONBody[QuotaSet],
    ) -> QuotaInfo:
        principal = (await authenticate(hub, request)).principal
        if principal.anonymous:
            raise NotAuthorizedException("log in as a site admin")
        if not principal.is_admin or (
            principal.token_scopes is not None and principal.token_scopes.get("*") != "admin"
        ):
            hub.audit.record(principal.name, client_ip(request), "quota.set", namespace, "denied")
            raise PermissionDeniedException("only site admins set quotas")
        try:
            async with hub.db.transaction() as session:
                await quotas.set_quota(session, namespace, data.quota_bytes)
                quota, used = await quotas.show(session, namespace)
        except InvalidInput as exc:
            raise _bad(exc) from exc
        hub.audit.record(
            principal.name, client_ip(request), "quota.set", namespace, "ok", quota_bytes=quota
        )
        return QuotaInfo(namespace, quota, used)
