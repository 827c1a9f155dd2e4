"""Who may do what: the one place that decides, for the OCI routes, ``/token``, the hub
API, the catalog UI and ``_catalog`` alike.

Rules:

- Roles are ordered ``pull`` < ``push`` < ``admin``. On a repository they grant
  registry actions: pull → {pull}; push → {pull, push}; admin → {pull, push, delete}.
- A repository belongs to the namespace named by its first component.
- A user's role on a namespace as a whole is the highest of their direct membership's
  role and the roles of their teams there that have no repository glob. Their role on a
  repository also counts the teams whose glob (``*``/``?``, e.g. ``acme/app-*``:
  ``accounts.team_glob_matches``) matches its full name.
- Site admins hold ``admin`` on every namespace and repository.
- An API token narrows all of that to its scopes (``NAMESPACE:ROLE``, ``*`` for any
  namespace): the lower of the two roles, none where no scope names the namespace. A UI
  session opened with a token is narrowed the same way.
- A public repository grants ``pull`` to anyone, signed in or not.
- A registry bearer token (``/token``) narrows further to the repositories and actions it
  was granted, on every surface (listings too), and manages no namespace or robot.
- Robots are managed (tokens minted, listed, revoked) by whoever administers every
  namespace the robot is a member of (site admins: any robot); a robot that is a member
  of nothing, or is a site admin itself, is the site admins' alone.

``Grants`` reads once what decides for one principal (memberships, teams) and answers
from it; ``visible`` turns the same answers into a SQL filter for listings, so what a
listing shows and what a route allows cannot disagree.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from sqlalchemy import ColumnElement, and_, false, or_, select, true
from sqlalchemy.orm import Session

from forkd.hub.accounts import (
    Principal,
    find_repository,
    max_role,
    namespace_of,
    team_glob_matches,
    team_glob_problem,
)
from forkd.hub.db import like_literal
from forkd.hub.models import (
    ROLES,
    ApiToken,
    Membership,
    Namespace,
    Repository,
    Team,
    TeamMember,
    User,
)
from forkd.names import shown

ROLE_ACTIONS: dict[str, frozenset[str]] = {
    "pull": frozenset({"pull"}),
    "push": frozenset({"pull", "push"}),
    "admin": frozenset({"pull", "push", "delete"}),
}
ALL_ACTIONS = ROLE_ACTIONS["admin"]
NOTHING: frozenset[str] = frozenset()


def lower_role(a: str | None, b: str | None) -> str | None:
    """The lower of two roles; None when either is None."""
    if a is None or b is None:
        return None
    return min(a, b, key=ROLES.index)


@dataclass(frozen=True)
class Grants:
    """What decides for one principal: their direct roles and teams, per namespace.

    Loaded for some namespaces or for all (``load``); asking about a namespace that was
    not loaded is a programming error."""

    principal: Principal
    namespace_roles: dict[str, str]  # direct memberships and glob-less teams
    # (organisation, glob, role) of teams with a glob: a glob grants in its team's
    # organisation only, and only when it has no problem (accounts.team_glob_problem).
    team_globs: tuple[tuple[str, str, str], ...]
    loaded: frozenset[str] | None  # None: every namespace

    @classmethod
    def load(
        cls, session: Session, principal: Principal, namespaces: Collection[str] | None = None
    ) -> Grants:
        """Read ``principal``'s memberships and teams (in ``namespaces`` only, if given)."""
        loaded = frozenset(namespaces) if namespaces is not None else None
        if principal.anonymous or principal.is_admin or principal.user_id is None:
            return cls(principal, {}, (), loaded)
        direct = select(Namespace.name, Membership.role).join(
            Membership, Membership.namespace_id == Namespace.id
        )
        teams = (
            select(Namespace.name, Team.repositories, Team.role)
            .join(Team, Team.namespace_id == Namespace.id)
            .join(TeamMember, TeamMember.team_id == Team.id)
        )
        direct = direct.where(Membership.user_id == principal.user_id)
        teams = teams.where(TeamMember.user_id == principal.user_id)
        if loaded is not None:
            direct = direct.where(Namespace.name.in_(loaded))
            teams = teams.where(Namespace.name.in_(loaded))
        roles: dict[str, str] = {}
        for ns, role in session.execute(direct).all():
            roles[ns] = max_role(roles.get(ns), role) or role
        globs: list[tuple[str, str, str]] = []
        for ns, pattern, role in session.execute(teams).all():
            if pattern:
                globs.append((ns, pattern, role))
            else:
                roles[ns] = max_role(roles.get(ns), role) or role
        return cls(principal, roles, tuple(globs), loaded)

    def _check_loaded(self, namespace: str) -> None:
        if self.loaded is not None and namespace not in self.loaded:
            raise RuntimeError(f"grants for namespace {shown(namespace)} were not loaded")

    def narrow(self, role: str | None, namespace: str) -> str | None:
        """``role`` as the principal's API token (if any) allows it on ``namespace``."""
        scopes = self.principal.token_scopes
        if scopes is None or role is None:
            return role
        return lower_role(role, scopes.get(namespace) or scopes.get("*"))

    def namespace_role(self, namespace: str) -> str | None:
        """The role on ``namespace`` as a whole (to manage its members, teams, robots)."""
        if self.principal.anonymous or self.principal.bearer_access is not None:
            return None
        self._check_loaded(namespace)
        role = "admin" if self.principal.is_admin else self.namespace_roles.get(namespace)
        return self.narrow(role, namespace)

    def repository_role(self, repository: str) -> str | None:
        """The role on ``repository`` (which may not exist yet)."""
        if self.principal.anonymous:
            return None
        namespace = namespace_of(repository)
        self._check_loaded(namespace)
        if self.principal.is_admin:
            role: str | None = "admin"
        else:
            role = max_role(
                self.namespace_roles.get(namespace),
                *(
                    r
                    for org, glob, r in self.team_globs
                    if team_glob_matches(org, repository, glob)
                ),
            )
        return self.narrow(role, namespace)

    def subject_actions(self, repository: str, public: bool) -> frozenset[str]:
        """The registry actions the principal's subject (user, narrowed by an API token)
        holds on ``repository`` (public: it grants pull to all), before a bearer token's
        own access list narrows them."""
        role = self.repository_role(repository)
        held = ROLE_ACTIONS[role] if role else NOTHING
        return held | ROLE_ACTIONS["pull"] if public else held

    def repository_actions(self, repository: str, public: bool) -> frozenset[str]:
        """The registry actions held on ``repository``, a bearer token's access included."""
        held = self.subject_actions(repository, public)
        bearer = self.principal.bearer_access
        return held if bearer is None else held & bearer.get(repository, NOTHING)

    def administers(self, namespaces: Iterable[str]) -> bool:
        """Whether the principal holds admin on every one of ``namespaces`` (and there is
        at least one): who may manage a robot that is a member of exactly those."""
        wanted = list(namespaces)
        return bool(wanted) and all(self.namespace_role(ns) == "admin" for ns in wanted)

    def may_manage_robot(self, robot_namespaces: Iterable[str]) -> bool:
        if self.principal.bearer_access is not None:
            return False
        if self.principal.is_admin and self.narrow("admin", "*") == "admin":
            return True
        return self.administers(robot_namespaces)


def grants(
    session: Session, principal: Principal, namespaces: Collection[str] | None = None
) -> Grants:
    return Grants.load(session, principal, namespaces)


def access(
    session: Session, principal: Principal, repository: str
) -> tuple[Repository | None, frozenset[str]]:
    """The repository (None if it does not exist yet) and the actions ``principal``'s
    subject holds on it: the check of every OCI route. Those routes apply a bearer
    token's access list themselves (``auth.permit``), so that a token short of scope is
    answered 403 insufficient_scope with the challenge to follow, not 404."""
    repo = find_repository(session, repository)
    held = Grants.load(session, principal, [namespace_of(repository)]).subject_actions(
        repository, repo is not None and repo.is_public
    )
    return repo, held


def repository_access(
    session: Session, principal: Principal, repository: str
) -> tuple[Repository | None, frozenset[str]]:
    """``access``, narrowed by a bearer token's access list too: for every surface but
    the OCI routes (README edits, the UI's push affordances)."""
    repo = find_repository(session, repository)
    held = Grants.load(session, principal, [namespace_of(repository)]).repository_actions(
        repository, repo is not None and repo.is_public
    )
    return repo, held


def repository_actions(
    session: Session, principal: Principal, repositories: Collection[str]
) -> dict[str, frozenset[str]]:
    """The actions held on each of ``repositories``, in one read (``/token``)."""
    found = {
        r.name: r
        for r in session.scalars(select(Repository).where(Repository.name.in_(repositories)))
    }
    g = Grants.load(session, principal, {namespace_of(r) for r in repositories})
    return {
        name: g.repository_actions(name, name in found and found[name].is_public)
        for name in repositories
    }


def namespace_role(session: Session, principal: Principal, namespace: str) -> str | None:
    """``principal``'s role on ``namespace`` as a whole; None for a namespace that does
    not exist."""
    exists = session.scalars(select(Namespace.id).where(Namespace.name == namespace)).first()
    if exists is None:
        return None
    return Grants.load(session, principal, [namespace]).namespace_role(namespace)


def admin_namespaces(
    session: Session, principal: Principal, kind: str | None = None, *, limit: int | None = None
) -> list[str]:
    """The namespaces ``principal`` administers, by name; ``kind``: only those of that
    kind (``org``, ``user``); ``limit``: the first that many (a site admin administers
    every namespace of the hub, which every user adds to)."""
    if principal.anonymous:
        return []
    g = Grants.load(session, principal)
    query = select(Namespace.name).order_by(Namespace.name)
    if kind is not None:
        query = query.where(Namespace.kind == kind)
    if not principal.is_admin:
        query = query.where(Namespace.name.in_(sorted(g.namespace_roles)))
    elif g.narrow("admin", "*") == "admin" and limit is not None:
        query = query.limit(limit)  # each is one it administers: read no more
    names = [ns for ns in session.scalars(query) if g.namespace_role(ns) == "admin"]
    return names if limit is None else names[:limit]


def visible(session: Session, principal: Principal) -> ColumnElement[bool]:
    """A filter on Repository: exactly the repositories ``principal`` may pull, by the
    same ``Grants`` answers the routes use."""
    if principal.bearer_access is None:
        return _visible(session, principal)
    granted = [name for name, actions in principal.bearer_access.items() if "pull" in actions]
    if not granted:
        return false()
    # What the token's subject may pull, then the token's own list: the subject's view is
    # read without the bearer (``namespace_role`` answers None for a bearer, since a token
    # manages nothing, which left out every repository its subject pulls by membership:
    # a token granted pull on a private repository pulled it and listed none of it).
    subject = replace(principal, bearer_access=None)
    return and_(_visible(session, subject), Repository.name.in_(granted))


def _visible(session: Session, principal: Principal) -> ColumnElement[bool]:
    public = Repository.is_public.is_(True)
    if principal.anonymous:
        return public
    g = Grants.load(session, principal)
    if principal.is_admin:
        scopes = principal.token_scopes
        if scopes is None or g.narrow("admin", "*") is not None:
            return true()
        namespaces = [ns for ns in scopes if g.namespace_role(ns)]
    else:
        namespaces = [ns for ns in g.namespace_roles if g.namespace_role(ns)]
    clauses: list[ColumnElement[bool]] = [public]
    if namespaces:
        clauses.append(
            Repository.namespace_id.in_(select(Namespace.id).where(Namespace.name.in_(namespaces)))
        )
    # Glob teams: one LIKE each, filtered by the database (never every repository of the
    # namespace read and matched here: a listing's cost would grow with the namespace),
    # behind their namespace's id, so another namespace's rows cost one comparison per
    # namespace, not one LIKE per glob.
    globs: dict[str, set[str]] = {}
    for ns, glob, role in g.team_globs:
        if ns not in namespaces and team_glob_problem(ns, glob) is None and g.narrow(role, ns):
            globs.setdefault(ns, set()).add(glob)
    if globs:
        ids = session.execute(select(Namespace.name, Namespace.id).where(Namespace.name.in_(globs)))
        clauses += [
            and_(Repository.namespace_id == ns_id, or_(*map(glob_clause, sorted(globs[ns]))))
            for ns, ns_id in ids.all()
        ]
    return or_(*clauses) if len(clauses) > 1 else (clauses[0] if clauses else false())


def glob_clause(glob: str) -> ColumnElement[bool]:
    """A filter on Repository: the repositories a team's ``glob`` (in the grammar of
    ``accounts.TEAM_GLOB_RE``) matches, as ``accounts.team_glob_matches`` decides."""
    pattern = "".join({"*": "%", "?": "_"}.get(c) or like_literal(c) for c in glob)
    return Repository.name.like(pattern, escape="\\")


def robot_namespaces(session: Session, robot_id: int) -> list[str]:
    """The namespaces a robot holds a place in, by name: those it is a direct member of
    and the organisations of the teams it is in (a team place is a right there as much as
    a membership is: who manages the robot's tokens manages that right)."""
    direct = select(Membership.namespace_id).where(Membership.user_id == robot_id)
    teams = (
        select(Team.namespace_id)
        .join(TeamMember, TeamMember.team_id == Team.id)
        .where(TeamMember.user_id == robot_id)
    )
    query = (
        select(Namespace.name)
        .where(or_(Namespace.id.in_(direct), Namespace.id.in_(teams)))
        .order_by(Namespace.name)
    )
    return list(session.scalars(query))


def may_manage_robot(session: Session, principal: Principal, robot_id: int) -> bool:
    """Whether ``principal`` may mint, see and revoke the tokens of robot ``robot_id``
    (and add it to a namespace or a team): they administer every namespace it holds a
    place in, as a member or through a team (``robot_namespaces``). A robot that is a
    site admin holds rights on every namespace, not only on those it holds a place in:
    only site admins manage it (an organisation's admins managed the operator's admin
    robot it had been made a member of: listed and revoked its ``*:admin`` tokens)."""
    robot = session.get(User, robot_id)
    if robot is None or not robot.is_robot or principal.anonymous:
        return False
    if robot.is_admin:
        return manages_every_robot(session, principal)
    namespaces = robot_namespaces(session, robot_id)
    return Grants.load(session, principal, namespaces).may_manage_robot(namespaces)


def minter_stands(session: Session, token: ApiToken) -> bool:
    """Whether ``token`` holds as far as its minter goes: a robot's token minted by another
    user (``ApiToken.minted_by``: an organisation admin, in the UI's robot form) stands
    only while that user still exists and may still manage the robot now
    (``may_manage_robot``). An admin removed from the organisation, or deleted, keeps no
    working secret that acts as its robot; the organisation's other admins mint new ones.
    Tokens without a minter (the operator's, an account's own) are not affected."""
    if token.minted_by is None or token.minted_by == token.user_id:
        return True
    minter = session.get(User, token.minted_by)
    if minter is None:
        return False
    as_minter = Principal(minter.id, minter.name, minter.is_admin)
    return may_manage_robot(session, as_minter, token.user_id)


def manages_every_robot(session: Session, principal: Principal) -> bool:
    """Whether ``principal`` may manage any robot (``Grants.may_manage_robot`` for a site
    admin acting as one: no registry bearer token, no token narrower than ``*:admin``)."""
    if principal.anonymous or not principal.is_admin:
        return False
    return Grants.load(session, principal, []).may_manage_robot(())


def manageable_robots(
    session: Session, principal: Principal, *, offset: int = 0, limit: int | None = None
) -> list[User]:
    """The robots ``principal`` may manage that hold a place (a membership or a team's) in
    a namespace they administer, by name: from ``offset``, at most ``limit`` of them.

    Decided by the database in one query, by ``may_manage_robot``'s rule (every namespace
    the robot holds a place in, ``robot_namespaces``, is one ``principal`` administers,
    ``admin_namespaces``): asking ``may_manage_robot`` robot by robot cost three reads per
    robot, and one page listed them all, so the tokens page of a site admin read every
    robot of the hub (any signed-in user makes up to 20 organisations of 100 robots)."""
    if principal.anonymous or principal.bearer_access is not None:
        return []
    direct = select(Membership.namespace_id).where(Membership.user_id == User.id)
    teams = (
        select(Team.namespace_id)
        .join(TeamMember, TeamMember.team_id == Team.id)
        .where(TeamMember.user_id == User.id)
    )
    query = select(User).where(User.is_robot.is_(True))
    if manages_every_robot(session, principal):
        query = query.where(or_(direct.exists(), teams.exists()))
    else:
        administered = admin_namespaces(session, principal)
        if not administered:
            return []
        ids = select(Namespace.id).where(Namespace.name.in_(administered))
        query = query.where(
            User.is_admin.is_(False),  # a site admin robot: site admins' (may_manage_robot)
            or_(
                direct.where(Membership.namespace_id.in_(ids)).exists(),
                teams.where(Team.namespace_id.in_(ids)).exists(),
            ),
            ~direct.where(Membership.namespace_id.not_in(ids)).exists(),
            ~teams.where(Team.namespace_id.not_in(ids)).exists(),
        )
    query = query.order_by(User.name, User.id).offset(offset)
    return list(session.scalars(query if limit is None else query.limit(limit)))
