"""Changing who is a direct member of a namespace: the one service behind the hub API
(``PUT``/``DELETE /api/v1/orgs/<org>/members/<user>``) and the catalog UI's member form,
so both apply the same rules:

- only an admin of the namespace (``authz``) changes its members;
- a robot joins, or changes role in, a namespace only through someone who may manage it
  (who administers every namespace it is already a member of): an admin of one
  organisation cannot take another's robot away by adding it to their own;
- a namespace never loses its last direct admin (demotion or removal);
- only organisations have members: a user's personal namespace is its owner's alone
  (``NoMembers``, 400 on every surface; ``accounts.set_member`` refuses it for the
  operator's shell too). A member stored there before this rule can still be removed.

The UI's robot form (``place_robot``) is the same change, for a robot it may make first.

A team's member holds the team's role in its organisation, so team changes
(``change_team``, ``team_member_allowed``) follow the same rules: only an organisation
admin, checked again in the transaction that writes, and a robot joins a team only
through someone who may manage it.

The shell's ``forkd hub org member`` is the site operator's and skips these checks.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from forkd import names
from forkd.errors import Conflict, ForkdError, InvalidInput
from forkd.hub import accounts, authz
from forkd.hub.accounts import Principal
from forkd.hub.models import ROLES, Membership, Namespace, User
from forkd.names import shown


class NotPermitted(ForkdError):
    """The caller may not make this change (the API answers 403)."""


NoMembers = accounts.NoMembers


async def change_member(
    session: AsyncSession, principal: Principal, namespace: str, username: str, role: str | None
) -> None:
    """Give ``username`` the direct ``role`` in ``namespace`` (None: remove them), as
    ``principal``. InvalidInput for unknown names or roles, NoMembers for a personal
    namespace, NotPermitted when the caller may not, Conflict when the namespace would be
    left without a direct admin."""
    ns, principal = await _administered_org(session, principal, namespace, role)
    user = await accounts.get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {shown(username)}")
    await _place(session, principal, ns, user, role)


async def place_robot(
    session: AsyncSession, principal: Principal, namespace: str, robot: str, role: str
) -> User:
    """The UI robot form's member change: ``robot`` holds ``role`` in ``namespace`` after
    it, made now as a robot of ``namespace`` when no account has the name (a short name
    ``ci`` names ``NAMESPACE+ci``, the only names a robot made here may have, or a robot
    named ``ci`` before that rule when the namespace has no ``NAMESPACE+ci``). The rules and
    refusals of ``change_member``, the API's, plus: Conflict when ``robot`` names a
    person, or ``namespace`` already made its ``MAX_ROBOTS_PER_NAMESPACE`` robots. The
    robot returned is the one to mint a token for."""
    ns, principal = await _administered_org(session, principal, namespace, role)
    user = await accounts.get_user(session, robot)
    if names.ROBOT_SEPARATOR not in robot:
        # A short name is the namespace's robot of that name: ``ci`` in acme is acme+ci
        # (accounts.claim_name: robots made here take no name a person could have), or a
        # robot of the plain name made before this rule, when acme has no acme+ci.
        own = await accounts.get_user(session, f"{ns.name}{names.ROBOT_SEPARATOR}{robot}")
        if own is not None or user is None or not user.is_robot:
            robot, user = f"{ns.name}{names.ROBOT_SEPARATOR}{robot}", own
    made_here = user is None
    if user is None:
        user = await accounts.create_robot_in(session, ns.name, robot)
    elif not user.is_robot:
        raise Conflict(f"{shown(robot)} is a person's account, not a robot")
    await _place(session, principal, ns, user, role, made_here=made_here)
    return user


async def _administered_org(
    session: AsyncSession, principal: Principal, namespace: str, role: str | None
) -> tuple[Namespace, Principal]:
    """The organisation ``namespace`` and ``principal`` as it is now, when ``principal``
    administers it now (read in the write transaction of the change: an admin removed or
    demoted while the request ran changes nothing, nor does a revoked token)."""
    if role is not None and role not in ROLES:
        raise InvalidInput(f"invalid role {shown(role)}: use pull, push or admin")
    ns = await accounts.get_namespace(session, namespace)
    if ns is None:
        raise InvalidInput(f"no such namespace {shown(namespace)}")
    principal = await accounts.current(session, principal)  # PrincipalChanged: 401
    if await session.run_sync(authz.namespace_role, principal, namespace) != "admin":
        raise NotPermitted(f"only admins of {shown(namespace)} change its members")
    if ns.kind != "org" and role is not None:
        # Removal goes on, to accounts.remove_member: a member stored before this rule
        # can be removed, the owner never.
        raise accounts.no_members(namespace)
    return ns, principal


async def _place(
    session: AsyncSession,
    principal: Principal,
    ns: Namespace,
    user: User,
    role: str | None,
    *,
    made_here: bool = False,
) -> None:
    """Write ``user``'s direct ``role`` in ``ns`` (None: remove them). A robot joins or
    changes role only through someone who may manage it (``made_here``: a robot this
    change just made for ``ns``, which holds no place yet); the namespace keeps a direct
    admin."""
    robot_joins = user.is_robot and role is not None and not made_here
    if robot_joins and not await session.run_sync(authz.may_manage_robot, principal, user.id):
        raise NotPermitted(
            f"robot {shown(user.name)} belongs to a namespace you do not administer; its "
            "owners (or a site admin) decide where it is a member: choose another name"
        )
    if ns.kind != "org" and user.name == ns.name:  # a personal namespace keeps its owner
        raise accounts.no_members(ns.name)
    if role != "admin":
        await keep_an_admin(session, ns, user)
    if role is None:
        await accounts.remove_member(session, ns.name, user.name)
    else:
        await accounts.set_member(session, ns.name, user, role)


async def keep_an_admin(session: AsyncSession, ns: Namespace, user: User) -> None:
    """Raise Conflict unless a direct admin member other than ``user`` stays.

    The admin rows are locked (PostgreSQL; SQLite serialises writers) so two concurrent
    demotions cannot each leave the other as the last admin and both go through."""
    admins = await session.scalars(
        select(Membership.user_id)
        .where(Membership.namespace_id == ns.id, Membership.role == "admin")
        .with_for_update()
    )
    ids = set(admins.all())
    if user.id in ids and not ids - {user.id}:
        raise Conflict(
            f"{shown(user.name)} is the last admin of {shown(ns.name)}: make another first"
        )


async def require_admin(session: AsyncSession, principal: Principal, namespace: str) -> None:
    """NotPermitted unless ``principal`` administers ``namespace`` now: read in the write
    transaction of the change, so an admin removed or demoted while the request ran
    changes nothing, and nor does one whose token was revoked (``accounts.current``)."""
    principal = await accounts.current(session, principal)  # PrincipalChanged: 401
    if await session.run_sync(authz.namespace_role, principal, namespace) != "admin":
        raise NotPermitted(f"only admins of {shown(namespace)} change its teams")


async def team_member_allowed(session: AsyncSession, principal: Principal, username: str) -> None:
    """InvalidInput for an unknown user; NotPermitted for a robot ``principal`` may not
    manage (its owners decide where it holds a role, by team as by membership)."""
    user = await accounts.get_user(session, username)
    if user is None:
        raise InvalidInput(f"no such user {shown(username)}")
    principal = await accounts.current(session, principal)  # PrincipalChanged: 401
    if user.is_robot and not await session.run_sync(authz.may_manage_robot, principal, user.id):
        raise NotPermitted(
            f"robot {shown(username)} belongs to a namespace you do not administer; its "
            "owners (or a site admin) decide which teams it is in"
        )
