"""Hub API: organisations, their members and teams, namespaces' storage quotas, users.

- ``POST /api/v1/orgs`` ``{"name"}``: any signed-in human user (not a robot) creates an
  organisation and becomes its admin member; needs the password (Basic), as token
  creation does: an API token or a registry bearer token cannot (403).
- ``GET /api/v1/orgs/<org>/members``: direct members (any member of the org or a site admin).
- ``PUT /api/v1/orgs/<org>/members/<user>`` ``{"role"}``, ``DELETE`` the same: set or remove
  a direct member (org admins only, as below); refused (409) when the organisation would be
  left without a direct admin member.
- ``GET /api/v1/orgs/<org>/teams``: teams with role, repository glob and members (same).
- ``POST /api/v1/orgs/<org>/teams`` ``{"name", "role", "repositories"?, "members"?}``,
  ``DELETE /api/v1/orgs/<org>/teams/<team>``,
  ``PUT``/``DELETE /api/v1/orgs/<org>/teams/<team>/members/<user>``: org admins only
  (an admin role on the organisation as a whole, direct or through a team without a glob)
  and site admins.
- ``GET /api/v1/namespaces/<ns>/quota``: ``{namespace, quota_bytes, used_bytes}`` (members
  and site admins); ``PUT`` ``{"quota_bytes": N | null}``: site admins only.
- ``GET``/``POST /api/v1/users`` ``{"name", "password"?, "admin"?, "robot"?}``,
  ``DELETE /api/v1/users/<name>``: site admins only, with the password (not an API token);
  never the last site admin who signs in with a password (an admin robot does not
  count). An organisation whose last direct admin is removed stays,
  managed by the site's admins (the audit record lists it), until they make another.

Anonymous callers get 401; callers without the needed role 403; an API token narrows as
everywhere (its scope on the organisation must reach the role).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

import anyio
import msgspec
from litestar import Controller, Request, delete, get, post, put
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.exceptions import (
    NotAuthorizedException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.params import FromPath, JSONBody
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd.audit import Actor
from forkd.bodies import Body
from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts, authz, members, quotas
from forkd.hub.auth import authenticate, client_ip
from forkd.hub.display import one_line
from forkd.hub.models import ROLES, Membership, Namespace, Team, User
from forkd.hub.oci.common import MAX_COUNT
from forkd.hub.services import Hub
from forkd.hub.tokens_api import _user
from forkd.names import shown

HubRequest = Request[object, object, State]


class OrgCreate(Body):
    name: str


@dataclass
class OrgInfo:
    name: str
    kind: str


class MemberSet(Body):
    role: str


@dataclass
class MemberInfo:
    user: str
    role: str
    robot: bool


def _glob_problem(org: str, team: Team) -> str | None:
    """Why ``team``'s stored glob grants nothing, and what to do; None when it is right."""
    problem = team.repositories and accounts.team_glob_problem(org, team.repositories)
    if not problem:
        return None
    return f"{problem}; this team grants nothing: remove it and make it again with a valid glob"


@dataclass
class TeamInfo:
    name: str
    role: str
    repositories: str  # glob on full repository names; "" = all of the org's repositories
    members: list[str]
    created_at: datetime
    # Why the glob grants nothing (stored before the checks, or by hand), and what to do;
    # None when it is right (accounts.team_glob_problem).
    problem: str | None = None


class TeamCreate(Body):
    name: str
    role: str
    repositories: str = ""
    # At most MAX_TEAM_MEMBERS_AT_ONCE (each a lookup and a row in the write transaction).
    members: Annotated[list[str], msgspec.Meta(max_length=accounts.MAX_TEAM_MEMBERS_AT_ONCE)] = (
        msgspec.field(default_factory=list)
    )


@dataclass
class QuotaInfo:
    namespace: str
    quota_bytes: int | None
    used_bytes: int


class QuotaSet(Body):
    # A byte count the database's BIGINT holds (past it, a 500 from the driver).
    quota_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] | None


class UserCreate(Body):
    name: str
    password: str | None = None
    admin: bool = False
    robot: bool = False


@dataclass
class UserInfo:
    name: str
    admin: bool
    robot: bool


async def _require(hub: Hub, request: HubRequest, namespace: str, role: str) -> None:
    """Pass if the caller holds ``role`` on ``namespace`` as a whole; else 401/403."""
    await _require_principal(hub, request, namespace, role)


async def _require_principal(
    hub: Hub, request: HubRequest, namespace: str, role: str
) -> tuple[Actor, accounts.Principal]:
    """``_require``, with the caller's principal."""
    principal = await _user(hub, request)
    held = await hub.db.read(authz.namespace_role, principal, namespace)
    if held is None or ROLES.index(held) < ROLES.index(role):
        hub.provoked.record(principal, client_ip(request), f"org.{role}", namespace, "denied")
        raise PermissionDeniedException(f"needs the {role} role on {shown(namespace)}")
    return principal, principal  # the actor the audit log names, and the principal


@asynccontextmanager
async def _permitted(
    hub: Hub, request: HubRequest, actor: Actor, target: str
) -> AsyncIterator[None]:
    """``members.NotPermitted`` answers 403 (and is audited)."""
    try:
        yield
    except members.NotPermitted as exc:
        hub.provoked.record(actor, client_ip(request), "member.change", target, "denied")
        raise PermissionDeniedException(str(exc)) from exc


async def _below_org_limit(session: AsyncSession, creator: User) -> None:
    """Conflict when ``creator`` has created ``MAX_ORGS_PER_USER`` organisations (any
    signed-in user creates them: without a bound one account could add namespaces
    without end). Counted by creator (``Namespace.created_by``), not by who administers
    them now: handing one over (another admin made, then left) gave the place back, so
    the bound bound nothing; and anyone could use up someone else's places by making
    them the admin of organisations. ``acting_user`` holds the user's row, so concurrent
    creations are counted one after another."""
    created = await session.scalar(
        select(func.count())
        .select_from(Namespace)
        .where(Namespace.created_by == creator.id, Namespace.kind == "org")
    )
    if (created or 0) >= accounts.MAX_ORGS_PER_USER:
        raise Conflict(
            f"you have created {created} organisations, the limit is "
            f"{accounts.MAX_ORGS_PER_USER}: ask a site admin to create another for you"
        )


async def _orgs_left_without_admin(session: AsyncSession, name: str) -> list[str]:
    """The organisations whose only direct admin is user ``name``, by name (rows locked,
    so no concurrent demotion slips between the count and the removal)."""
    user = await accounts.get_user(session, name)
    if user is None:
        return []
    administered = await session.scalars(
        select(Membership.namespace_id)
        .where(Membership.user_id == user.id, Membership.role == "admin")
        .with_for_update()
    )
    left: list[str] = []
    for ns_id in administered.all():
        admins = await session.scalars(
            select(Membership.user_id)
            .where(Membership.namespace_id == ns_id, Membership.role == "admin")
            .with_for_update()
        )
        ns = await session.get(Namespace, ns_id)
        if set(admins.all()) == {user.id} and ns is not None and ns.kind == "org":
            left.append(ns.name)
    return sorted(left)


def _is_robot(session: Session, user_id: int | None) -> bool:
    user = session.get(User, user_id) if user_id is not None else None
    return user is None or user.is_robot


def _bad(exc: InvalidInput | Conflict) -> Exception:
    if isinstance(exc, Conflict):
        from litestar.exceptions import HTTPException

        return HTTPException(status_code=409, detail=str(exc))
    return ValidationException(str(exc))


@asynccontextmanager
async def _writing(hub: Hub) -> AsyncIterator[AsyncSession]:
    """A write transaction whose InvalidInput / Conflict answer 400 / 409."""
    try:
        async with hub.db.transaction() as session:
            yield session
    except (InvalidInput, Conflict) as exc:
        raise _bad(exc) from exc


@asynccontextmanager
async def _reading(hub: Hub) -> AsyncIterator[AsyncSession]:
    """A read transaction whose InvalidInput answers 400."""
    try:
        async with hub.db.reading() as session:
            yield session
    except InvalidInput as exc:
        raise _bad(exc) from exc


class OrgController(Controller):
    path = "/api/v1/orgs"

    @post("/")
    async def create_org(
        self, request: HubRequest, hub: NamedDependency[Hub], data: JSONBody[OrgCreate]
    ) -> OrgInfo:
        principal = await _user(hub, request)
        if not principal.with_password or await hub.db.read(_is_robot, principal.user_id):
            hub.provoked.record(principal, client_ip(request), "org.create", "-", "denied")
            raise PermissionDeniedException(
                "only a user signed in with the password (not an API token, a registry bearer "
                "token or a robot) creates organisations"
            )
        try:
            async with _writing(hub) as session:
                # The caller's row by id and stamp, in this transaction: never a user or
                # robot given the name since the request was authenticated.
                creator = await accounts.acting_user(session, principal)  # held: counted
                if creator.is_robot:
                    raise PermissionDeniedException("a robot creates no organisations")
                if not creator.is_admin:
                    await _below_org_limit(session, creator)
                await accounts.create_org(session, data.name, creator)
                await accounts.set_member(session, data.name, creator, "admin")
        except accounts.PrincipalChanged as exc:
            raise NotAuthorizedException(str(exc)) from exc
        hub.audit.record(principal, client_ip(request), "org.create", data.name, "ok")
        return OrgInfo(data.name, "org")

    @get("/{org:str}/members")
    async def list_members(
        self, request: HubRequest, hub: NamedDependency[Hub], org: FromPath[str]
    ) -> list[MemberInfo]:
        await _require(hub, request, org, "pull")
        async with _reading(hub) as session:
            rows = await accounts.list_members(session, org)
        return [MemberInfo(n, r, robot) for n, r, robot in rows]

    @put("/{org:str}/members/{username:str}", status_code=204)
    async def set_member(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        username: FromPath[str],
        data: JSONBody[MemberSet],
    ) -> None:
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.change_member(session, principal, org, username, data.role)
        hub.audit.record(
            actor, client_ip(request), "member.set", org, "ok", user=username, role=data.role
        )

    @delete("/{org:str}/members/{username:str}")
    async def remove_org_member(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        username: FromPath[str],
    ) -> None:
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.change_member(session, principal, org, username, None)
        hub.audit.record(actor, client_ip(request), "member.remove", org, "ok", user=username)

    @get("/{org:str}/teams")
    async def list_teams(
        self, request: HubRequest, hub: NamedDependency[Hub], org: FromPath[str]
    ) -> list[TeamInfo]:
        await _require(hub, request, org, "pull")
        async with _reading(hub) as session:
            rows = await accounts.list_teams(session, org)
        return [
            TeamInfo(
                t.name, t.role, one_line(t.repositories), m, t.created_at, _glob_problem(org, t)
            )
            for t, m in rows
        ]

    @post("/{org:str}/teams")
    async def create_team(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        org: FromPath[str],
        data: JSONBody[TeamCreate],
    ) -> TeamInfo:
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.require_admin(session, principal, org)
            for username in dict.fromkeys(data.members):
                await members.team_member_allowed(session, principal, username)
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
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.require_admin(session, principal, org)
            await accounts.delete_team(session, org, team)
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
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.require_admin(session, principal, org)
            await members.team_member_allowed(session, principal, username)
            await accounts.add_team_member(session, org, team, username)
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
        actor, principal = await _require_principal(hub, request, org, "admin")
        async with _writing(hub) as session, _permitted(hub, request, actor, org):
            await members.require_admin(session, principal, org)
            await accounts.remove_team_member(session, org, team, username)
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
        async with _reading(hub) as session:
            quota, used = await quotas.show(session, namespace)
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
        if not principal.site_admin:
            hub.provoked.record(principal, client_ip(request), "quota.set", namespace, "denied")
            raise PermissionDeniedException("only site admins set quotas")
        async with _writing(hub) as session:
            if not (await accounts.current(session, principal)).site_admin:  # still one?
                raise PermissionDeniedException("only site admins set quotas")
            await quotas.set_quota(session, namespace, data.quota_bytes)
            quota, used = await quotas.show(session, namespace)
        hub.audit.record(
            principal, client_ip(request), "quota.set", namespace, "ok", quota_bytes=quota
        )
        return QuotaInfo(namespace, quota, used)


async def _site_admin(
    hub: Hub, request: HubRequest, action: str, target: str
) -> accounts.Principal:
    """The caller if a site admin signed in with the password; else 401/403."""
    principal = await _user(hub, request)
    if not principal.is_admin or not principal.with_password:
        hub.provoked.record(principal, client_ip(request), action, target, "denied")
        raise _not_site_admin()
    return principal


def _not_site_admin() -> PermissionDeniedException:
    return PermissionDeniedException(
        "only site admins signed in with the password (not an API token or a registry "
        "bearer token) manage users"
    )


async def _still_site_admin(session: AsyncSession, principal: accounts.Principal) -> None:
    """In the write transaction: the caller is a site admin still (not removed or demoted,
    its password unchanged since the request was authenticated: 401/403)."""
    if not (await accounts.current(session, principal)).is_admin:
        raise _not_site_admin()


class UserController(Controller):
    path = "/api/v1/users"

    @get("/")
    async def list_users(self, request: HubRequest, hub: NamedDependency[Hub]) -> list[UserInfo]:
        await _site_admin(hub, request, "user.list", "-")  # a read: nothing to hold
        async with hub.db.reading() as session:
            users = await accounts.list_users(session)
        return [UserInfo(u.name, u.is_admin, u.is_robot) for u in users]

    @post("/")
    async def create_user(
        self, request: HubRequest, hub: NamedDependency[Hub], data: JSONBody[UserCreate]
    ) -> UserInfo:
        admin = await _site_admin(hub, request, "user.create", data.name[:64])
        actor: Actor = admin
        try:
            accounts.validate_account(data.name)  # the rest: accounts.claim_name
            if data.password is not None:
                if data.robot:
                    raise InvalidInput("robot accounts log in with tokens only, not passwords")
                accounts.check_password(data.password)
            # argon2 takes tens of milliseconds of CPU by design: off the event loop, and
            # before the write transaction.
            hashed = (
                await anyio.to_thread.run_sync(accounts.hash_password, data.password)
                if data.password is not None
                else None
            )
            async with hub.db.transaction() as session:
                await _still_site_admin(session, admin)
                user = await accounts.create_user(
                    session, data.name, None, admin=data.admin, robot=data.robot
                )
                user.password_hash = hashed
        except (InvalidInput, Conflict) as exc:
            raise _bad(exc) from exc
        hub.audit.record(
            actor,
            client_ip(request),
            "user.create",
            data.name,
            "ok",
            admin=data.admin,
            robot=data.robot,
        )
        return UserInfo(data.name, data.admin, data.robot)

    @delete("/{name:str}")
    async def remove_user(
        self, request: HubRequest, hub: NamedDependency[Hub], name: FromPath[str]
    ) -> None:
        admin = await _site_admin(hub, request, "user.remove", name)
        actor = admin
        async with _writing(hub) as session:
            await _still_site_admin(session, admin)
            # Site admins who sign in with a password: a robot that is a site admin cannot
            # manage users (tokens only), so it keeps no one in charge of the hub's API.
            admins = await session.scalars(
                select(User.name)
                .where(User.is_admin.is_(True), User.is_robot.is_(False))
                .with_for_update()
            )
            if set(admins.all()) == {name}:
                raise Conflict(
                    f"{shown(name)} is the last site admin who signs in with a password "
                    "(robots that are site admins cannot manage users): make another first"
                )
            # Organisations the user is the last direct admin of are left to the site's
            # admins (who manage every namespace): refusing here let any organisation
            # admin make anyone undeletable, by making them an admin and then leaving.
            orphaned = await _orgs_left_without_admin(session, name)
            await accounts.remove_user(session, name)
        hub.audit.record(
            actor, client_ip(request), "user.remove", name, "ok", orphaned_orgs=orphaned
        )
