"""Users, namespaces (personal and organisations), memberships, API tokens, permissions.

Roles and token scopes are ordered: ``pull`` < ``push`` < ``admin``. On a
repository they grant registry actions: pull → {pull}; push → {pull, push};
admin → {pull, push, delete}. A repository belongs to the namespace named by
the first component of its name. Site admins hold every action; a public
repository grants pull to anyone. An API token narrows its user's rights to
its scopes (``NAMESPACE:ROLE``, ``*`` for any namespace).

Teams: an organisation's team gives its members one role on the organisation's
repositories, all of them or those whose full name matches the team's glob
(``fnmatch``, e.g. ``acme/app-*``). A user's effective role on a repository is the
highest of their direct membership's role and the roles of their teams that cover it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from fnmatch import fnmatchcase

import anyio
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from sqlalchemy import bindparam, delete, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd.errors import Conflict, InvalidInput
from forkd.hub.models import (
    ROLES,
    ApiToken,
    Membership,
    Namespace,
    Repository,
    Team,
    TeamMember,
    User,
    utcnow,
)
from forkd.names import NAME_COMPONENT

ROLE_ACTIONS: dict[str, frozenset[str]] = {
    "pull": frozenset({"pull"}),
    "push": frozenset({"pull", "push"}),
    "admin": frozenset({"pull", "push", "delete"}),
}
ALL_ACTIONS = ROLE_ACTIONS["admin"]
TEAM_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?$")
USER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?$")
NAMESPACE_RE = re.compile(rf"^{NAME_COMPONENT}$")
TOKEN_PREFIX = "fkd_"
_hasher = PasswordHasher()
# Verified against when a user does not exist, so timing does not reveal which names exist.
_DUMMY_HASH = _hasher.hash("forkd-no-such-user")


def validate_username(name: str) -> str:
    if not isinstance(name, str) or not USER_RE.match(name) or "__" in name:
        raise InvalidInput(
            f"invalid user name {str(name)[:80]!r}: use 1-64 lowercase letters, digits, '-' or "
            "'_', starting and ending with a letter or digit"
        )
    return name


def validate_namespace(name: str) -> str:
    if not isinstance(name, str) or len(name) > 255 or not NAMESPACE_RE.match(name):
        raise InvalidInput(
            f"invalid namespace {str(name)[:80]!r}: one repository-name component "
            "(lowercase letters, digits, '.', '_', '-')"
        )
    return name


def namespace_of(repository: str) -> str:
    return repository.split("/", 1)[0]


MIN_PASSWORD = 8


def check_password(password: str, what: str = "password") -> None:
    if len(password) < MIN_PASSWORD:
        raise InvalidInput(f"{what} too short: use at least {MIN_PASSWORD} characters")


def hash_password(password: str) -> str:
    check_password(password)
    return _hasher.hash(password)


def verify_password(stored: str | None, password: str) -> bool:
    try:
        return _hasher.verify(stored or _DUMMY_HASH, password) and stored is not None
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def hash_token(secret: str) -> str:
    """Tokens are 256-bit random: a plain sha256 is a sound way to store them."""
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_scopes(text: str) -> dict[str, str]:
    """``"ns:push other:pull"`` → {"ns": "push", "other": "pull"}; ``*`` means any namespace."""
    scopes: dict[str, str] = {}
    for item in text.split():
        ns, sep, role = item.partition(":")
        if not sep or role not in ROLES:
            raise InvalidInput(f"invalid token scope {item!r}: use NAMESPACE:pull|push|admin")
        if ns != "*":
            validate_namespace(ns)
        scopes[ns] = role
    if not scopes:
        raise InvalidInput("a token needs at least one scope, e.g. myorg:push")
    return scopes


@dataclass(frozen=True)
class Principal:
    """Who is asking: a user (maybe through an API token, which narrows), or nobody."""

    user_id: int | None = None
    name: str = ""
    is_admin: bool = False
    token_scopes: dict[str, str] | None = None  # None: not narrowed by an API token
    token_id: int | None = None

    @property
    def anonymous(self) -> bool:
        return self.user_id is None


ANONYMOUS = Principal()


# -- lookups -------------------------------------------------------------------
# The reads that decide access are plain (sync) ORM functions: the hub runs them inline
# on SQLite through ``Database.read`` (the hot path of every registry request), and async
# code calls them through ``AsyncSession.run_sync``, as the wrappers below do.
# Built once (bound parameters): building a statement costs more than SQLite running it.
_USER = select(User).where(User.name == bindparam("name"))
_NAMESPACE = select(Namespace).where(Namespace.name == bindparam("name"))
_REPOSITORY = select(Repository).where(Repository.name == bindparam("name"))
_USER_TEAMS = (
    select(Team)
    .join(TeamMember, TeamMember.team_id == Team.id)
    .where(
        Team.namespace_id == bindparam("namespace_id"), TeamMember.user_id == bindparam("user_id")
    )
)


def find_user(session: Session, name: str) -> User | None:
    return session.scalars(_USER, {"name": name}).first()


def find_namespace(session: Session, name: str) -> Namespace | None:
    return session.scalars(_NAMESPACE, {"name": name}).first()


def find_repository(session: Session, name: str) -> Repository | None:
    return session.scalars(_REPOSITORY, {"name": name}).first()


async def get_user(session: AsyncSession, name: str) -> User | None:
    return await session.run_sync(find_user, name)


async def get_namespace(session: AsyncSession, name: str) -> Namespace | None:
    return await session.run_sync(find_namespace, name)


async def get_repository(session: AsyncSession, name: str) -> Repository | None:
    return await session.run_sync(find_repository, name)


async def authenticate_password(
    session: AsyncSession, username: str, password: str
) -> Principal | None:
    """Check a user's password, or an API token given as the password. None when wrong."""
    user = await get_user(session, username) if USER_RE.match(username or "") else None
    if password.startswith(TOKEN_PREFIX):
        token = (
            await session.scalars(
                select(ApiToken).where(ApiToken.token_hash == hash_token(password))
            )
        ).first()
        if token is None or user is None or token.user_id != user.id:
            return None
        if token.expires_at is not None and _aware(token.expires_at) <= utcnow():
            return None
        return Principal(user.id, user.name, user.is_admin, parse_scopes(token.scopes), token.id)
    # argon2 takes tens of milliseconds of CPU by design: keep it off the event loop.
    stored = user.password_hash if user else None
    if not await anyio.to_thread.run_sync(verify_password, stored, password) or user is None:
        return None
    return Principal(user.id, user.name, user.is_admin)


def token_principal(session: Session, user_id: int, token_id: int | None) -> Principal | None:
    """Re-resolve a bearer token's subject now (revoked users and tokens stop working)."""
    user = session.get(User, user_id)
    if user is None:
        return None
    if token_id is None:
        return Principal(user.id, user.name, user.is_admin)
    token = session.get(ApiToken, token_id)
    if token is None or token.user_id != user.id:
        return None
    if token.expires_at is not None and _aware(token.expires_at) <= utcnow():
        return None
    return Principal(user.id, user.name, user.is_admin, parse_scopes(token.scopes), token.id)


def repository_actions(session: Session, principal: Principal, repository: str) -> frozenset[str]:
    """The registry actions ``principal`` holds on ``repository`` (which may not exist yet)."""
    return access(session, principal, repository)[1]


def access(
    session: Session, principal: Principal, repository: str
) -> tuple[Repository | None, frozenset[str]]:
    """The repository (None if it does not exist yet) and the actions ``principal`` holds."""
    repo = find_repository(session, repository)
    public = frozenset({"pull"}) if repo is not None and repo.is_public else frozenset()
    if principal.anonymous:
        return repo, public
    if principal.is_admin:
        held = ALL_ACTIONS
    else:
        ns = find_namespace(session, namespace_of(repository))
        role = None
        if ns is not None and principal.user_id is not None:
            role = effective_role(session, ns.id, principal.user_id, repository)
        held = ROLE_ACTIONS[role] if role else frozenset()
    if principal.token_scopes is not None:
        scope = principal.token_scopes.get(namespace_of(repository)) or principal.token_scopes.get(
            "*"
        )
        held = held & ROLE_ACTIONS[scope] if scope else frozenset()
    return repo, held | public


def max_role(*roles: str | None) -> str | None:
    """The highest of ``roles`` (pull < push < admin); None when there is none."""
    present = [r for r in roles if r]
    return max(present, key=ROLES.index) if present else None


def team_covers(team: Team, repository: str | None) -> bool:
    """Whether ``team``'s role applies to ``repository`` (None: the organisation itself,
    which only a team without a glob covers)."""
    if not team.repositories:
        return True
    return repository is not None and fnmatchcase(repository, team.repositories)


def user_teams(session: Session, namespace_id: int, user_id: int) -> list[Team]:
    return list(session.scalars(_USER_TEAMS, {"namespace_id": namespace_id, "user_id": user_id}))


def effective_role(
    session: Session, namespace_id: int, user_id: int, repository: str | None
) -> str | None:
    """Max of the user's direct role in the namespace and their teams' roles that cover
    ``repository`` (None: the namespace as a whole, e.g. to manage it)."""
    member = session.get(Membership, (namespace_id, user_id))
    teams = user_teams(session, namespace_id, user_id)
    return max_role(
        member.role if member else None,
        *(t.role for t in teams if team_covers(t, repository)),
    )


def namespace_role(session: Session, principal: Principal, namespace: str) -> str | None:
    """``principal``'s role on the namespace as a whole (site admins: admin), narrowed by an
    API token's scope."""
    if principal.anonymous or principal.user_id is None:
        return None
    ns = find_namespace(session, namespace)
    if ns is None:
        return None
    role = (
        "admin" if principal.is_admin else effective_role(session, ns.id, principal.user_id, None)
    )
    if principal.token_scopes is not None:
        scope = principal.token_scopes.get(namespace) or principal.token_scopes.get("*")
        role = min(role, scope, key=ROLES.index) if role and scope else None
    return role


# -- teams ---------------------------------------------------------------------
def validate_team(name: str) -> str:
    if not isinstance(name, str) or not TEAM_RE.match(name):
        raise InvalidInput(
            f"invalid team name {str(name)[:80]!r}: use 1-64 lowercase letters, digits, '-' or "
            "'_', starting and ending with a letter or digit"
        )
    return name


async def get_org(session: AsyncSession, org: str) -> Namespace:
    """The organisation named ``org``; InvalidInput when there is none."""
    ns = await get_namespace(session, org)
    if ns is None or ns.kind != "org":
        raise InvalidInput(f"no such organisation {org!r}")
    return ns


async def get_team(session: AsyncSession, org: str, team: str) -> Team:
    ns = await get_org(session, org)
    row = (
        await session.scalars(select(Team).where(Team.namespace_id == ns.id, Team.name == team))
    ).first()
    if row is None:
        raise InvalidInput(f"no team {team!r} in {org!r}")
    return row


async def create_team(
    session: AsyncSession,
    org: str,
    name: str,
    role: str,
    *,
    repositories: str = "",
    members: tuple[str, ...] | list[str] = (),
) -> Team:
    """A team of organisation ``org`` with ``role`` on its repositories (or those matching
    the ``repositories`` glob, e.g. ``acme/app-*``)."""
    validate_team(name)
    if role not in ROLES:
        raise InvalidInput(f"invalid role {role!r}: use pull, push or admin")
    ns = await get_org(session, org)
    if repositories and (len(repositories) > 255 or not repositories.startswith(f"{org}/")):
        raise InvalidInput(
            f"invalid repository glob {repositories[:80]!r}: it must start with {org + '/'!r}"
        )
    exists_ = (
        await session.scalars(select(Team.id).where(Team.namespace_id == ns.id, Team.name == name))
    ).first()
    if exists_ is not None:
        raise Conflict(f"team {name!r} already exists in {org!r}")
    team = Team(namespace_id=ns.id, name=name, role=role, repositories=repositories)
    session.add(team)
    await session.flush()
    for member in members:
        await add_team_member(session, org, name, member)
    return team


async def delete_team(session: AsyncSession, org: str, name: str) -> None:
    team = await get_team(session, org, name)
    await session.execute(delete(TeamMember).where(TeamMember.team_id == team.id))
    await session.delete(team)


async def add_team_member(session: AsyncSession, org: str, team_name: str, username: str) -> None:
    team = await get_team(session, org, team_name)
    user = await get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {username!r}")
    await session.execute(
        delete(TeamMember).where(TeamMember.team_id == team.id, TeamMember.user_id == user.id)
    )
    session.add(TeamMember(team_id=team.id, user_id=user.id))
    await session.flush()


async def remove_team_member(
    session: AsyncSession, org: str, team_name: str, username: str
) -> None:
    team = await get_team(session, org, team_name)
    user = await get_user(session, username)
    row = await session.get(TeamMember, (team.id, user.id)) if user else None
    if row is None:
        raise InvalidInput(f"{username!r} is not in team {team_name!r} of {org!r}")
    await session.delete(row)


async def list_teams(session: AsyncSession, org: str) -> list[tuple[Team, list[str]]]:
    """The organisation's teams with their members' names, by team name."""
    ns = await get_org(session, org)
    teams = list(
        await session.scalars(select(Team).where(Team.namespace_id == ns.id).order_by(Team.name))
    )
    rows = (
        await session.execute(
            select(TeamMember.team_id, User.name)
            .join(User, User.id == TeamMember.user_id)
            .where(TeamMember.team_id.in_([t.id for t in teams]))
            .order_by(User.name)
        )
    ).all()
    members: dict[int, list[str]] = {t.id: [] for t in teams}
    for team_id, username in rows:
        members[team_id].append(username)
    return [(t, members[t.id]) for t in teams]


async def list_members(session: AsyncSession, namespace: str) -> list[tuple[str, str, bool]]:
    """Direct members of a namespace: (user name, role, robot), by name."""
    ns = await get_namespace(session, namespace)
    if ns is None:
        raise InvalidInput(f"no such namespace {namespace!r}")
    rows = await session.execute(
        select(User.name, Membership.role, User.is_robot)
        .join(Membership, Membership.user_id == User.id)
        .where(Membership.namespace_id == ns.id)
        .order_by(User.name)
    )
    return [(n, r, bool(robot)) for n, r, robot in rows.all()]


# -- administration ------------------------------------------------------------
async def create_user(
    session: AsyncSession,
    name: str,
    password: str | None,
    *,
    admin: bool = False,
    robot: bool = False,
) -> User:
    """A user with a personal namespace of the same name (admin role in it)."""
    validate_username(name)
    if await get_user(session, name) is not None:
        raise Conflict(f"user {name!r} already exists")
    if robot and password:
        raise InvalidInput("robot accounts log in with tokens only, not passwords")
    user = User(
        name=name,
        password_hash=hash_password(password) if password else None,
        is_admin=admin,
        is_robot=robot,
    )
    session.add(user)
    await session.flush()
    if not robot:
        ns = await get_namespace(session, name)
        if ns is not None:
            raise Conflict(f"namespace {name!r} already exists (an organisation?)")
        ns = Namespace(name=name, kind="user")
        session.add(ns)
        await session.flush()
        session.add(Membership(namespace_id=ns.id, user_id=user.id, role="admin"))
    return user


async def create_org(session: AsyncSession, name: str) -> Namespace:
    validate_namespace(name)
    if await get_namespace(session, name) is not None:
        raise Conflict(f"namespace {name!r} already exists")
    ns = Namespace(name=name, kind="org")
    session.add(ns)
    await session.flush()
    return ns


async def set_member(session: AsyncSession, namespace: str, username: str, role: str) -> None:
    if role not in ROLES:
        raise InvalidInput(f"invalid role {role!r}: use pull, push or admin")
    ns = await get_namespace(session, namespace)
    user = await get_user(session, username)
    if ns is None or user is None:
        raise InvalidInput(f"no such namespace {namespace!r} or user {username!r}")
    member = await session.get(Membership, (ns.id, user.id))
    if member is None:
        session.add(Membership(namespace_id=ns.id, user_id=user.id, role=role))
    else:
        member.role = role


async def create_token(
    session: AsyncSession,
    username: str,
    name: str,
    scopes: str,
    *,
    expires_in: timedelta | None = None,
) -> str:
    """A new API token for ``username``; returns the secret (shown once, stored hashed)."""
    user = await get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {username!r}")
    parsed = parse_scopes(scopes)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(
            user_id=user.id,
            name=name[:64] or "token",
            token_hash=hash_token(secret),
            scopes=" ".join(f"{ns}:{role}" for ns, role in sorted(parsed.items())),
            expires_at=utcnow() + expires_in if expires_in else None,
        )
    )
    await session.flush()
    return secret


async def create_repository(
    session: AsyncSession, name: str, *, public: bool, admin_may_create_namespace: bool
) -> Repository:
    ns_name = namespace_of(name)
    ns = await get_namespace(session, ns_name)
    if ns is None:
        if not admin_may_create_namespace:
            raise InvalidInput(f"namespace {ns_name!r} does not exist")
        ns = Namespace(name=ns_name, kind="org")
        session.add(ns)
        await session.flush()
    repo = Repository(name=name, namespace_id=ns.id, is_public=public)
    session.add(repo)
    await session.flush()
    return repo


async def set_visibility(session: AsyncSession, name: str, public: bool) -> None:
    repo = await get_repository(session, name)
    if repo is None:
        raise InvalidInput(f"no such repository {name!r}")
    repo.is_public = public


async def list_users(session: AsyncSession) -> list[User]:
    return list((await session.scalars(select(User).order_by(User.name))).all())


async def remove_user(session: AsyncSession, name: str) -> None:
    """Remove a user with their memberships and tokens; their namespace and its
    repositories stay (a site admin still manages them)."""
    user = await get_user(session, name)
    if user is None:
        raise InvalidInput(f"no such user {name!r}")
    await session.execute(delete(Membership).where(Membership.user_id == user.id))
    await session.execute(delete(TeamMember).where(TeamMember.user_id == user.id))
    await session.execute(delete(ApiToken).where(ApiToken.user_id == user.id))
    await session.delete(user)


async def list_tokens(session: AsyncSession, username: str) -> list[ApiToken]:
    user = await get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {username!r}")
    query = select(ApiToken).where(ApiToken.user_id == user.id).order_by(ApiToken.id)
    return list((await session.scalars(query)).all())


async def revoke_token(session: AsyncSession, token_id: int) -> None:
    token = await session.get(ApiToken, token_id)
    if token is None:
        raise InvalidInput(f"no token with id {token_id}")
    await session.delete(token)


async def remove_member(session: AsyncSession, namespace: str, username: str) -> None:
    ns = await get_namespace(session, namespace)
    user = await get_user(session, username)
    member = await session.get(Membership, (ns.id, user.id)) if ns and user else None
    if member is None:
        raise InvalidInput(f"{username!r} is not a member of {namespace!r}")
    await session.delete(member)


async def has_users(session: AsyncSession) -> bool:
    return (await session.scalars(select(User.id).limit(1))).first() is not None


def _aware(ts: datetime) -> datetime:
    from datetime import UTC

    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)
