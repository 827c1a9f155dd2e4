"""Users, namespaces (personal and organisations), memberships, teams, API tokens and
the authentication of a principal. What a principal may do is decided in
``forkd.hub.authz`` alone.

Teams: an organisation's team gives its members one role on the organisation's
repositories, all of them or those whose full name matches the team's glob
(``acme/app-*``: ``*`` any run of characters, ``/`` included, ``?`` any one; no
``[...]`` classes, so that each glob is one SQL ``LIKE`` and a listing is filtered by
the database: ``team_glob_matches`` and ``authz.visible`` agree by construction).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Literal

import anyio
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from litestar.exceptions import NotAuthorizedException
from sqlalchemy import bindparam, delete, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd import names
from forkd.errors import Conflict, ForkdError, InvalidInput
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import (
    ROLES,
    ApiToken,
    Membership,
    Namespace,
    Repository,
    Team,
    TeamMember,
    UiSession,
    User,
    new_stamp,
    utcnow,
)
from forkd.names import shown

# Names are validated by the one set of full-match validators in forkd.names.
USER_RE = names.USER_RE
validate_username = names.validate_username
validate_account = names.validate_account
validate_namespace = names.validate_namespace
validate_team = names.validate_team
TOKEN_PREFIX = "fkd_"
_hasher = PasswordHasher()
# Verified against when a user does not exist, so timing does not reveal which names exist.
_DUMMY_HASH = _hasher.hash("forkd-no-such-user")


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


# A team's repository glob: name characters, ``*`` and ``?`` (see the module's doc).
TEAM_GLOB_RE = names.whole(r"[a-z0-9._/*?-]+")


def team_glob_problem(org: str, glob: str) -> str | None:
    """What is wrong with ``glob`` as a repository glob of a team of ``org`` (None: it is
    right). Checked when a team is made; a stored glob with a problem (made before the
    checks, or written to the database by hand) grants nothing, and listings of the
    team say why (``TeamInfo.problem``, ``forkd hub team list``)."""
    if (
        len(glob) > names.MAX_NAME
        or not glob.startswith(f"{org}/")
        or not names.matches(TEAM_GLOB_RE, glob)
    ):
        return (
            f"invalid repository glob {shown(glob)}: it must start with "
            f"{org + '/'!r} and use only lowercase letters, digits, '.', '_', '-', '/', "
            f"'*' (any characters) and '?' (one character), at most {names.MAX_NAME}"
        )
    return None


def team_glob_matches(org: str, repository: str, glob: str) -> bool:
    """Whether the ``glob`` of a team of ``org`` grants on ``repository``. A stored glob
    with a problem (``team_glob_problem``: e.g. a ``[...]`` class, or another
    organisation's name) matches nothing: a listing could not filter it in SQL, and a
    team grants within its own organisation only, so it grants nowhere rather than
    differently or elsewhere."""
    return (
        team_glob_problem(org, glob) is None
        and repository.startswith(f"{org}/")
        and fnmatchcase(repository, glob)
    )


def hash_token(secret: str) -> str:
    """Tokens are 256-bit random: a plain sha256 is a sound way to store them."""
    return hashlib.sha256(secret.encode()).hexdigest()


# What one account may make (rows it alone decides to add; each is read by the requests
# and pages that list them): API tokens of one user or robot, organisations one user
# creates (site admins: no limit), teams of one organisation.
MAX_TOKENS_PER_USER = 100
MAX_ORGS_PER_USER = 20
# Characters of an API token's name (its column): longer is refused, never cut.
TOKEN_NAME_MAX = 64
MAX_TEAMS_PER_ORG = 100
# Robot accounts a namespace's admins make (the UI's robot form: any organisation admin,
# and any signed-in user makes organisations): each is a user row and a name no one
# else can take.
MAX_ROBOTS_PER_NAMESPACE = 100
# Members one team-creating request may name (each is a row and a lookup in one write
# transaction); more are added one request each.
MAX_TEAM_MEMBERS_AT_ONCE = 100

# What one API token may carry: a token names a handful of namespaces, and its scopes
# are read on every request made with it.
MAX_TOKEN_SCOPES = 64
MAX_TOKEN_SCOPE_TEXT = 2048  # characters of the space-separated scope list


def parse_scopes(text: str) -> dict[str, str]:
    """``"ns:push other:pull"`` → {"ns": "push", "other": "pull"}; ``*`` means any namespace.
    At most ``MAX_TOKEN_SCOPES`` namespaces in ``MAX_TOKEN_SCOPE_TEXT`` characters; a
    repeated scope counts once, one namespace with two roles is refused. Cached by the
    text: ``_principal`` parses a token's stored scopes on every request."""
    if len(text) > MAX_TOKEN_SCOPE_TEXT:
        raise InvalidInput(
            f"token scopes are {len(text)} characters, the limit is {MAX_TOKEN_SCOPE_TEXT}: "
            "name fewer namespaces (or use *:ROLE for all of them)"
        )
    return dict(_scope_items(text))


@lru_cache(maxsize=1024)
def _scope_items(text: str) -> tuple[tuple[str, str], ...]:
    """``parse_scopes``'s work, once per distinct scope text (immutable: shared)."""
    scopes: dict[str, str] = {}
    for item in dict.fromkeys(text.split()):
        ns, sep, role = item.partition(":")
        if not sep or role not in ROLES:
            raise InvalidInput(f"invalid token scope {shown(item)}: use NAMESPACE:pull|push|admin")
        if ns != "*":
            validate_namespace(ns)
        if scopes.get(ns, role) != role:
            raise InvalidInput(
                f"token scopes give namespace {shown(ns)} two roles ({scopes[ns]}, {role}): "
                "give each namespace one role"
            )
        scopes[ns] = role
        if len(scopes) > MAX_TOKEN_SCOPES:
            raise InvalidInput(
                f"a token may name at most {MAX_TOKEN_SCOPES} namespaces: name fewer "
                "(or use *:ROLE for all of them)"
            )
    if not scopes:
        raise InvalidInput("a token needs at least one scope, e.g. myorg:push")
    return tuple(scopes.items())


def token_scopes(token: ApiToken) -> dict[str, str]:
    """A stored token's scopes, as ``parse_scopes`` reads them; 403 DENIED with what to do
    when they no longer parse (a token created before the scope limits, over them)."""
    try:
        return parse_scopes(token.scopes)
    except InvalidInput as exc:
        reason = (
            f"API token {shown(token.name)} (id {token.id}) can no longer be used: {exc}; "
            "revoke it and create a new one within the limits"
        )
        raise RegistryError(Code.DENIED, reason, message=reason) from None


@dataclass(frozen=True)
class Principal:
    """Who is asking: a user (maybe through an API token, which narrows), or nobody."""

    user_id: int | None = None
    name: str = ""
    is_admin: bool = False
    token_scopes: dict[str, str] | None = None  # None: not narrowed by an API token
    token_id: int | None = None
    # ``principal_stamp`` of the user (and token) when authenticated: what sessions,
    # bearer tokens and cached credentials carry, checked again on every request.
    stamp: str = ""
    # Set when the request came with a registry bearer token (``/token``): the only
    # repositories and actions it may use, on every surface; it manages nothing.
    bearer_access: Mapping[str, frozenset[str]] | None = None

    @property
    def with_password(self) -> bool:
        """Authenticated by the password itself (Basic, or a UI session opened with it),
        not through an API token or a registry bearer token: what account changes need."""
        return not self.anonymous and self.token_id is None and self.bearer_access is None

    @property
    def anonymous(self) -> bool:
        return self.user_id is None

    @property
    def site_admin(self) -> bool:
        """A site admin acting as one: with the password (or a UI session), or an API
        token with scope ``*:admin``; never through a registry bearer token."""
        if not self.is_admin or self.bearer_access is not None:
            return False
        return self.token_scopes is None or self.token_scopes.get("*") == "admin"


ANONYMOUS = Principal()


# -- lookups -------------------------------------------------------------------
# The reads that decide access are plain (sync) ORM functions: the hub runs them inline
# on SQLite through ``Database.read`` (the hot path of every registry request), and async
# code calls them through ``AsyncSession.run_sync``, as the wrappers below do.
# Built once (bound parameters): building a statement costs more than SQLite running it.
_USER = select(User).where(User.name == bindparam("name"))
_NAMESPACE = select(Namespace).where(Namespace.name == bindparam("name"))
_REPOSITORY = select(Repository).where(Repository.name == bindparam("name"))


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


def principal_stamp(user: User, token: ApiToken | None) -> str:
    """What a session, bearer token or cached credential carries to name exactly this
    user (and API token): a hash of the user's random stamp and the token's hash. A
    removed and re-created user, a revoked token whose id came back, or a password
    change all give another value."""
    token_part = f"{token.id}:{token.token_hash}" if token else ""
    material = f"{user.id}:{user.stamp}:{token_part}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def _principal(user: User, token: ApiToken | None) -> Principal | None:
    """The principal ``user`` is through ``token`` (None: the token is not theirs or has
    expired)."""
    if token is None:
        return Principal(user.id, user.name, user.is_admin, stamp=principal_stamp(user, None))
    if token.user_id != user.id:
        return None
    if token.expires_at is not None and aware(token.expires_at) <= utcnow():
        return None
    return Principal(
        user.id,
        user.name,
        user.is_admin,
        token_scopes(token),
        token.id,
        principal_stamp(user, token),
    )


async def authenticate_password(
    session: AsyncSession, username: str, password: str
) -> Principal | None:
    """Check a user's password, or an API token given as the password. None when wrong."""
    user = await get_user(session, username) if names.is_account_name(username) else None
    if password.startswith(TOKEN_PREFIX):
        token = (
            await session.scalars(
                select(ApiToken).where(ApiToken.token_hash == hash_token(password))
            )
        ).first()
        if token is None or user is None:
            return None
        if not await session.run_sync(_minter_stands, token):
            return None
        return _principal(user, token)
    # argon2 takes tens of milliseconds of CPU by design: keep it off the event loop.
    stored = user.password_hash if user else None
    if not await anyio.to_thread.run_sync(verify_password, stored, password) or user is None:
        return None
    return _principal(user, None)


def token_principal(
    session: Session, user_id: int, token_id: int | None, stamp: str
) -> Principal | None:
    """Re-resolve the subject of a session, bearer token or cached credential now: None
    unless the same user (and API token) still exists with the same stamp, so removed
    users, revoked tokens and changed passwords stop working at once, even where an id
    was handed out again."""
    user = session.get(User, user_id)
    if user is None or not stamp:
        return None
    token = session.get(ApiToken, token_id) if token_id is not None else None
    if token_id is not None and token is None:
        return None
    principal = _principal(user, token)
    if principal is None or not hmac.compare_digest(principal.stamp, stamp):
        return None
    if token is not None and not _minter_stands(session, token):
        return None
    return principal


def _minter_stands(session: Session, token: ApiToken) -> bool:
    """Whether a robot's token minted by someone else still holds (``authz.minter_stands``):
    checked wherever a token is taken, as the stamp is."""
    from forkd.hub import authz  # authz builds on this module's Principal

    return authz.minter_stands(session, token)


class PrincipalChanged(NotAuthorizedException, ForkdError):
    """The user a request was authenticated as is gone, or is no longer the same (removed,
    password changed, the API token revoked), by the time the request writes for them:
    401, sign in again (a route that does not catch it answers so, as any 401)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail=detail)

    def __str__(self) -> str:
        return self.detail


def _acting_user(session: Session, principal: Principal) -> User:
    user_id = principal.user_id
    user = (
        session.scalars(select(User).where(User.id == user_id).with_for_update()).first()
        if user_id is not None
        else None
    )
    # The stamp the request was authenticated with, re-resolved now (token_principal).
    same = user is not None and token_principal(
        session, user.id, principal.token_id, principal.stamp
    )
    if user is None or not same:
        raise PrincipalChanged(
            "your account was removed, or its password or token changed, while this request "
            "ran; nothing was done: sign in again"
        )
    return user


async def acting_user(session: AsyncSession, principal: Principal) -> User:
    """The row of the user ``principal`` is, read in this write transaction by id (never
    by name: a user removed meanwhile and another account created under the name must
    not receive what this request makes) and checked against the principal's stamp; on
    PostgreSQL the row is held (``FOR UPDATE``) so a removal waits for the commit, and then
    takes what this request made with it, and so do the user's other requests that count
    what the user has (``MAX_TOKENS_PER_USER``, ``MAX_ORGS_PER_USER``): two cannot both
    take the last place. Raises ``PrincipalChanged``."""
    return await session.run_sync(_acting_user, principal)


def _current(session: Session, principal: Principal) -> Principal:
    if principal.anonymous:
        return principal
    user = _acting_user(session, principal)
    fresh = token_principal(session, user.id, principal.token_id, principal.stamp)
    assert fresh is not None  # _acting_user checked it
    return replace(fresh, bearer_access=principal.bearer_access)


async def current(session: AsyncSession, principal: Principal) -> Principal:
    """``principal`` as it is now, read in this write transaction (``acting_user``: by id
    and stamp, the row held): what the request was authenticated as may have changed
    since (a site admin removed, an API token revoked, a password changed), and a write
    decided on the old reading would be made for someone who no longer may. Every write
    that decides from who the caller is (not only from memberships, which it reads anew
    anyway) asks this first. Raises ``PrincipalChanged`` (401)."""
    return await session.run_sync(_current, principal)


def max_role(*roles: str | None) -> str | None:
    """The highest of ``roles`` (pull < push < admin); None when there is none."""
    present = [r for r in roles if r]
    return max(present, key=ROLES.index) if present else None


# -- teams ---------------------------------------------------------------------
async def get_org(session: AsyncSession, org: str) -> Namespace:
    """The organisation named ``org``; InvalidInput when there is none."""
    ns = await get_namespace(session, org)
    if ns is None or ns.kind != "org":
        raise InvalidInput(f"no such organisation {shown(org)}")
    return ns


async def get_team(session: AsyncSession, org: str, team: str) -> Team:
    ns = await get_org(session, org)
    row = (
        await session.scalars(select(Team).where(Team.namespace_id == ns.id, Team.name == team))
    ).first()
    if row is None:
        raise InvalidInput(f"no team {shown(team)} in {shown(org)}")
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
        raise InvalidInput(f"invalid role {shown(role)}: use pull, push or admin")
    ns = await get_org(session, org)
    problem = team_glob_problem(org, repositories) if repositories else None
    if problem:
        raise InvalidInput(problem)
    exists_ = (
        await session.scalars(select(Team.id).where(Team.namespace_id == ns.id, Team.name == name))
    ).first()
    if exists_ is not None:
        raise Conflict(f"team {shown(name)} already exists in {shown(org)}")
    if len(set(members)) > MAX_TEAM_MEMBERS_AT_ONCE:
        raise InvalidInput(
            f"a new team names at most {MAX_TEAM_MEMBERS_AT_ONCE} members; add the others "
            "one at a time"
        )
    # The organisation's row held (PostgreSQL) while counting: creations take turns.
    await session.execute(select(Namespace.id).where(Namespace.id == ns.id).with_for_update())
    teams = await session.scalar(
        select(func.count()).select_from(Team).where(Team.namespace_id == ns.id)
    )
    if (teams or 0) >= MAX_TEAMS_PER_ORG:
        raise Conflict(
            f"{shown(org)} has {teams} teams, the limit is {MAX_TEAMS_PER_ORG}: remove some first"
        )
    team = Team(namespace_id=ns.id, name=name, role=role, repositories=repositories)
    session.add(team)
    await session.flush()
    for member in dict.fromkeys(members):
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
        raise InvalidInput(f"no such user {shown(username)}")
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
        raise InvalidInput(f"{shown(username)} is not in team {shown(team_name)} of {shown(org)}")
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
        raise InvalidInput(f"no such namespace {shown(namespace)}")
    rows = await session.execute(
        select(User.name, Membership.role, User.is_robot)
        .join(Membership, Membership.user_id == User.id)
        .where(Membership.namespace_id == ns.id)
        .order_by(User.name)
    )
    return [(n, r, bool(robot)) for n, r, robot in rows.all()]


# -- administration ------------------------------------------------------------
# Top-level paths of the hub's own routes: a namespace of such a name would have its UI
# page (``/NAME``) hidden behind them (found by hub review 13).
RESERVED_NAMESPACES = frozenset({"v2", "api", "token", "metrics", "healthz"})


def check_new_namespace(name: str) -> None:
    """InvalidInput for a name no new namespace may take (``RESERVED_NAMESPACES``)."""
    if name in RESERVED_NAMESPACES:
        raise InvalidInput(
            f"{shown(name)} is reserved: the hub serves /{name} itself, so a namespace of "
            "that name would have no page; choose another name"
        )


async def claim_name(
    session: AsyncSession,
    name: str,
    kind: Literal["user", "robot", "namespace"],
    *,
    robot_of: str | None = None,
) -> None:
    """The one rule for a new name, on every path that makes a principal or a namespace
    (the API, the UI's forms, the operator's ``forkd hub`` commands, a site admin's push):
    InvalidInput for a name of the wrong form or reserved, Conflict for one taken.

    Users, robots and namespaces share one pool of names: a user's name is its personal
    namespace's, so a namespace of that name, or an account of that name (a robot has no
    namespace), keeps the user from being made, and the other way round. ``kind``:

    - ``"user"``: a person (the operator's); a user name, free as an account and as a
      namespace, not reserved;
    - ``"robot"`` with ``robot_of``: a robot an admin of that namespace makes (the UI's
      robot form): named ``NAMESPACE+NAME`` (``names.validate_robot``), which no person or
      namespace can be named, so the robots any user makes in the organisations it creates
      take no name from the pool (they took names of people the operator had yet to
      create, up to 2,000 per user);
    - ``"robot"`` without ``robot_of``: the operator's robot: either form (a plain name is
      claimed as a person's is);
    - ``"namespace"``: an organisation, or a namespace a site admin's push creates."""
    if kind == "robot" and (robot_of is not None or names.ROBOT_SEPARATOR in name):
        names.validate_robot(name, robot_of or name.partition(names.ROBOT_SEPARATOR)[0])
        if robot_of is None and await get_namespace(session, namespace_of_robot(name)) is None:
            raise InvalidInput(
                f"no namespace {shown(namespace_of_robot(name))} to name the robot "
                f"{shown(name)} after: create it first, or give the robot a user's name"
            )
        if await get_user(session, name) is not None:
            raise Conflict(f"robot {shown(name)} already exists: choose another name")
        return
    if kind == "namespace":
        validate_namespace(name)
    else:
        validate_username(name)
    check_new_namespace(name)
    taken = await get_user(session, name)
    if taken is not None:
        what = "robot" if taken.is_robot else "user"
        raise Conflict(f"{what} {shown(name)} already exists: choose another name")
    if await get_namespace(session, name) is not None:
        raise Conflict(
            f"namespace {shown(name)} already exists (an organisation's, or a removed "
            "user's, which stays): choose another name"
        )


def namespace_of_robot(name: str) -> str:
    """``acme`` for the robot ``acme+ci``; "" for a name without ``+``."""
    head, sep, _ = name.partition(names.ROBOT_SEPARATOR)
    return head if sep else ""


async def create_user(
    session: AsyncSession,
    name: str,
    password: str | None,
    *,
    admin: bool = False,
    robot: bool = False,
    robot_of: str | None = None,
) -> User:
    """A user with a personal namespace of the same name (admin role in it); a robot
    (``robot``) has none. The name is claimed by ``claim_name``."""
    if robot and password:
        raise InvalidInput("robot accounts log in with tokens only, not passwords")
    await claim_name(session, name, "robot" if robot else "user", robot_of=robot_of)
    user = User(
        name=name,
        password_hash=hash_password(password) if password else None,
        is_admin=admin,
        is_robot=robot,
    )
    session.add(user)
    await session.flush()
    if not robot:
        ns = Namespace(name=name, kind="user")
        session.add(ns)
        await session.flush()
        session.add(Membership(namespace_id=ns.id, user_id=user.id, role="admin"))
    return user


async def create_robot_in(session: AsyncSession, namespace: str, name: str) -> User:
    """A new robot account ``name`` for ``namespace``'s admins (who then make it a member);
    Conflict when ``namespace`` has ``MAX_ROBOTS_PER_NAMESPACE`` robots already: robot
    members, and the robots made for it (``User.robot_for``) whether still members or
    not (a robot removed from the namespace stays an account and a name no one else can
    take, so removing one gives no place back). Counted with the namespace's row held
    (PostgreSQL; SQLite's writers are serial), so creations racing for the last place
    take turns."""
    ns = await get_namespace(session, namespace)
    if ns is None:
        raise InvalidInput(f"no such namespace {shown(namespace)}")
    await session.execute(select(Namespace.id).where(Namespace.id == ns.id).with_for_update())
    members = select(Membership.user_id).where(Membership.namespace_id == ns.id)
    held = await session.scalar(
        select(func.count())
        .select_from(User)
        .where(User.is_robot.is_(True), or_(User.robot_for == ns.id, User.id.in_(members)))
    )
    if (held or 0) >= MAX_ROBOTS_PER_NAMESPACE:
        raise Conflict(
            f"{shown(namespace)} has {held} robots, the limit is {MAX_ROBOTS_PER_NAMESPACE}: "
            "mint another token for one of them, or ask a site admin to remove some"
        )
    robot = await create_user(session, name, None, robot=True, robot_of=ns.name)
    robot.robot_for = ns.id
    return robot


def answerable_user(session: Session, user_id: int) -> int:
    """The user who answers for ``user_id``'s use of shared places (the hub's compaction
    places): a user answers for itself; a robot made for a user's own namespace, for that
    user; one made for an organisation, for the organisation's creator (any signed-in
    user creates organisations and up to ``MAX_ROBOTS_PER_NAMESPACE`` robots in each, so
    counting each robot apart gave one person as many places as it made robots). A robot
    of an organisation a site admin made (no creator), or made before robots recorded
    their namespace, answers for itself. Sync ORM code."""
    user = session.get(User, user_id)
    if user is None or not user.is_robot or user.robot_for is None:
        return user_id
    ns = session.get(Namespace, user.robot_for)
    if ns is None:
        return user_id
    if ns.kind == "user":
        owner = find_user(session, ns.name)
        return owner.id if owner is not None else user_id
    return ns.created_by if ns.created_by is not None else user_id


def answered_for(session: Session, user_id: int) -> tuple[int, set[int]]:
    """``answerable_user(user_id)`` and every account it answers for: itself and the
    robots made for its own namespace or for organisations it created. What bounds one
    user's share of a place (``upload_sessions_per_user``) counts them together. Sync
    ORM code."""
    head = answerable_user(session, user_id)
    user = session.get(User, head)
    if user is None or user.is_robot:
        return head, {head, user_id}
    made = select(Namespace.id).where(
        or_(
            Namespace.created_by == head,
            (Namespace.kind == "user") & (Namespace.name == user.name),
        )
    )
    robots = session.scalars(
        select(User.id).where(User.is_robot.is_(True), User.robot_for.in_(made))
    ).all()
    return head, {head, user_id, *robots}


async def create_org(session: AsyncSession, name: str, creator: User | None = None) -> Namespace:
    """A new organisation; ``creator``: the user it counts against (``MAX_ORGS_PER_USER``).

    An organisation a user (not a site admin) creates starts with the storage quota of
    that user's own namespace, when it has one: any signed-in user creates organisations
    and pushes into them, so a quota on the user's namespace alone bounded nothing (the
    same bytes went into an organisation without one). A site admin may change it."""
    await claim_name(session, name, "namespace")
    quota = None
    if creator is not None and not creator.is_admin:
        quota = await session.scalar(
            select(Namespace.quota_bytes).where(
                Namespace.name == creator.name, Namespace.kind == "user"
            )
        )
    ns = Namespace(
        name=name,
        kind="org",
        created_by=creator.id if creator else None,
        quota_bytes=quota,
        used_bytes=None if quota is None else 0,  # nothing stored yet: the running total
    )
    session.add(ns)
    await session.flush()
    return ns


class NoMembers(InvalidInput):
    """The namespace is a user's personal one: it takes no members but its owner (400)."""


def no_members(namespace: str) -> NoMembers:
    return NoMembers(
        f"{shown(namespace)} is a user's personal namespace: it has no members but its "
        "owner; make an organisation (POST /api/v1/orgs) and give others roles there"
    )


async def set_member(
    session: AsyncSession, namespace: str, username: str | User, role: str
) -> None:
    """Give ``username`` (a name, or a user row this transaction read) ``role`` on the
    namespace, an organisation (NoMembers for a user's personal namespace: on every
    surface, the operator's shell included)."""
    if role not in ROLES:
        raise InvalidInput(f"invalid role {shown(role)}: use pull, push or admin")
    ns = await get_namespace(session, namespace)
    user = await get_user(session, username) if isinstance(username, str) else username
    if ns is None or user is None:
        named = username if isinstance(username, str) else username.name
        raise InvalidInput(f"no such namespace {shown(namespace)} or user {shown(named)}")
    if ns.kind != "org":
        raise no_members(namespace)
    member = await session.get(Membership, (ns.id, user.id))
    if member is None:
        session.add(Membership(namespace_id=ns.id, user_id=user.id, role=role))
    else:
        member.role = role


async def create_token(
    session: AsyncSession,
    username: str | User,
    name: str,
    scopes: str,
    *,
    expires_in: timedelta | None = None,
    minted_by: int | None = None,
) -> str:
    """A new API token for ``username`` (a name, or a user row this transaction read:
    ``acting_user`` for the caller's own); returns the secret (shown once, stored hashed).
    ``minted_by``: the user id of who mints a robot's token for it; the token then stands
    only while they may still manage the robot (``authz.minter_stands``)."""
    if isinstance(username, str):
        found = await get_user(session, username)
        if found is None:
            raise InvalidInput(f"no such user {shown(username)}")
        user = found
    else:
        user = username
    if len(name) > TOKEN_NAME_MAX:
        raise InvalidInput(
            f"a token's name is at most {TOKEN_NAME_MAX} characters, not {len(name)}"
        )
    # Listed to its owner, a robot's managers and the operator (``forkd hub token list``):
    # no escape sequence or line break of the caller's reaches their terminal or page.
    names.validate_line(name, "a token's name")
    parsed = parse_scopes(scopes)
    # The user's row held (PostgreSQL) while counting: concurrent creations take turns.
    await session.execute(select(User.id).where(User.id == user.id).with_for_update())
    held = await session.scalar(
        select(func.count()).select_from(ApiToken).where(ApiToken.user_id == user.id)
    )
    if (held or 0) >= MAX_TOKENS_PER_USER:
        raise Conflict(
            f"{shown(user.name)} has {held} API tokens, the limit is {MAX_TOKENS_PER_USER}: "
            "revoke some first"
        )
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(
            user_id=user.id,
            name=name or "token",
            token_hash=hash_token(secret),
            scopes=" ".join(f"{ns}:{role}" for ns, role in sorted(parsed.items())),
            expires_at=utcnow() + expires_in if expires_in else None,
            minted_by=minted_by if minted_by != user.id else None,
        )
    )
    await session.flush()
    return secret


REPOSITORY_CREATE_LOCK_CLASS = 0x7265706F  # "repo": one namespace's creations take turns


async def create_repository(
    session: AsyncSession,
    name: str,
    *,
    public: bool,
    admin_may_create_namespace: bool,
    most: int | None = None,
) -> Repository:
    """A new repository ``name``; with ``most`` (the ``repositories_max`` setting) 403
    DENIED when its namespace has that many already. Counted under a per-namespace
    advisory lock on PostgreSQL (taken before the repository's and the quota's locks, in
    the order of ``Database.repository_lock``), so creations racing for the last place
    do not pass together; SQLite's writers are serial."""
    ns_name = namespace_of(name)
    ns = await get_namespace(session, ns_name)
    if ns is None:
        if not admin_may_create_namespace:
            raise InvalidInput(f"namespace {shown(ns_name)} does not exist")
        await claim_name(session, ns_name, "namespace")
        ns = Namespace(name=ns_name, kind="org")
        session.add(ns)
        await session.flush()
    if most is not None:
        if session.get_bind().dialect.name == "postgresql":
            await session.execute(
                text("SELECT pg_advisory_xact_lock(:cls, :ns)"),
                {"cls": REPOSITORY_CREATE_LOCK_CLASS, "ns": ns.id},
            )
        held = await session.scalar(
            select(func.count()).select_from(Repository).where(Repository.namespace_id == ns.id)
        )
        if (held or 0) >= most:
            reason = (
                f"namespace {shown(ns_name)} has {held} repositories, the limit is {most} "
                "(repositories_max): push into an existing one, or ask the hub's operator"
            )
            raise RegistryError(Code.DENIED, reason, message=reason)
    repo = Repository(name=name, namespace_id=ns.id, is_public=public)
    session.add(repo)
    await session.flush()
    return repo


async def set_visibility(session: AsyncSession, name: str, public: bool) -> None:
    repo = await get_repository(session, name)
    if repo is None:
        raise InvalidInput(f"no such repository {shown(name)}")
    repo.is_public = public


async def list_users(session: AsyncSession) -> list[User]:
    return list((await session.scalars(select(User).order_by(User.name))).all())


async def remove_user(session: AsyncSession, name: str) -> None:
    """Remove a user with their memberships and tokens; their namespace and its
    repositories stay (a site admin still manages them)."""
    user = await get_user(session, name)
    if user is None:
        raise InvalidInput(f"no such user {shown(name)}")
    await session.execute(delete(UiSession).where(UiSession.user_id == user.id))
    await session.execute(delete(Membership).where(Membership.user_id == user.id))
    await session.execute(delete(TeamMember).where(TeamMember.user_id == user.id))
    await session.execute(delete(ApiToken).where(ApiToken.user_id == user.id))
    await session.delete(user)


async def set_password(session: AsyncSession, name: str, password_hash: str | None) -> None:
    """Give ``name`` a new password (hashed with ``hash_password``; None: none, tokens
    only). Its stamp changes, so every session and bearer token minted before ends."""
    user = await get_user(session, name)
    if user is None:
        raise InvalidInput(f"no such user {shown(name)}")
    if user.is_robot and password_hash is not None:
        raise InvalidInput("robot accounts log in with tokens only, not passwords")
    user.password_hash = password_hash
    user.stamp = new_stamp()
    await session.execute(delete(UiSession).where(UiSession.user_id == user.id))


async def list_tokens(session: AsyncSession, username: str) -> list[ApiToken]:
    user = await get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {shown(username)}")
    query = select(ApiToken).where(ApiToken.user_id == user.id).order_by(ApiToken.id)
    return list((await session.scalars(query)).all())


async def revoke_token(session: AsyncSession, token_id: int) -> None:
    token = await session.get(ApiToken, token_id)
    if token is None:
        raise InvalidInput(f"no token with id {token_id}")
    await session.execute(delete(UiSession).where(UiSession.token_id == token_id))
    await session.delete(token)


async def remove_member(session: AsyncSession, namespace: str, username: str) -> None:
    """Remove ``username``'s direct membership. In a user's personal namespace only a
    member stored before personal namespaces refused members can go, never its owner
    (NoMembers)."""
    ns = await get_namespace(session, namespace)
    user = await get_user(session, username)
    if ns is not None and ns.kind != "org" and username == ns.name:
        raise no_members(namespace)
    member = await session.get(Membership, (ns.id, user.id)) if ns and user else None
    if member is None:
        raise InvalidInput(f"{shown(username)} is not a member of {shown(namespace)}")
    await session.delete(member)


async def has_users(session: AsyncSession) -> bool:
    return (await session.scalars(select(User.id).limit(1))).first() is not None


def aware(ts: datetime) -> datetime:
    """``ts`` with UTC attached where the database dropped it (SQLite)."""
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)
