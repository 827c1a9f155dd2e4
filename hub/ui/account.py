"""Sign in and out, personal and robot tokens, team membership, README editing (forms)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlencode

from litestar import Controller, Response, get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.exceptions import (
    ClientException,
    HTTPException,
    InternalServerException,
    NotFoundException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.params import FromPath
from litestar.response import Redirect
from sqlalchemy import and_, delete, select
from sqlalchemy.orm import Session

from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts, authz, members
from forkd.hub.auth import client_ip, login
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import ROLES, ApiToken, UiSession, User, utcnow
from forkd.hub.oci.common import parse_count
from forkd.hub.params import PAGES_MAX, QueryNumber, path_id, query_number
from forkd.hub.services import Hub
from forkd.hub.ui import queries
from forkd.hub.ui.common import UI, HubRequest, base_context, local_path, viewer
from forkd.hub.ui.errors import HTML_ERRORS
from forkd.hub.ui.render import README_MAX
from forkd.hub.ui.session import (
    COOKIE,
    LOGIN_COOKIE,
    LOGIN_PATH,
    LOGIN_TTL,
    NEW_TOKEN_COOKIE,
    NEW_TOKEN_PATH,
    SESSION_TTL,
    Viewer,
    cookie_name,
    cookie_path,
    over_https,
    read_cookie,
)
from forkd.hub.ui.text import DESCRIPTION_MAX, check_text, set_text
from forkd.names import validate_name

FORM_MAX = 300 * 1024
# Browser sessions one credential of an account (its password, or one API token) keeps
# open at once; a new sign-in with it ends its oldest beyond.
SESSIONS_PER_USER = 20
# Pages that may show a secret, or a form bound to a one-off cookie: never cached.
NO_STORE = {"Cache-Control": "no-store"}


class ClientGone(ClientException):
    """The client closed its connection before its form's body ended. Nothing went wrong
    on the hub and no one reads the answer: a 400, never the 500 page's traceback (an
    ERROR of ~30 lines that any anonymous client could have logged at will, by opening a
    sign-in form's request and closing it), and silent as the JSON routes are."""


async def _form(request: HubRequest) -> FormMultiDict:
    """The form in the request's body; ``ClientGone`` when its client went away first."""
    try:
        return await request.form()
    except InternalServerException:  # Litestar's only one here: "client disconnected"
        raise ClientGone("the client went away before its form's body ended") from None


def _field(form: FormMultiDict, key: str, limit: int = 300, *, cut: bool = False) -> str:
    """The form's ``key`` (stripped), at most ``limit`` characters: a longer one is a 400
    naming the field, never cut to fit (a README or description cut short, a user name
    or scope list cut into another one, stored without a word). ``cut``: a value that
    may be cut (where to go after sign-in)."""
    value = form.get(key)
    if not isinstance(value, str):
        return ""
    if len(value) > limit and not cut:
        raise ValidationException(
            f"the form's {key} is {len(value)} characters, the limit is {limit}: shorten it"
        )
    return value[:limit].strip()


def _set_cookie(
    response: Response[Any],
    request: HubRequest,
    name: str,
    value: str,
    *,
    max_age: int | None,
    path: str,
    samesite: Literal["lax", "strict"] = "strict",
) -> None:
    """An HttpOnly cookie, Secure when the request came over HTTPS or the hub's
    ``public_url`` is https (a TLS-terminating proxy forwards plain HTTP, and the browser
    must not send the session on a plain-HTTP visit), and then named ``__Host-NAME`` with
    ``Path=/`` (``session.cookie_name``: no other host can set it); ``max_age`` None: a
    browser-session cookie, kept in memory, not on disk."""
    secure = over_https(request)
    response.set_cookie(
        cookie_name(request, name),
        value,
        max_age=max_age,
        path=cookie_path(request, path),
        httponly=True,
        samesite=samesite,
        secure=secure,
    )


def _delete_cookie(response: Response[Any], request: HubRequest, name: str, path: str) -> None:
    """Clear the cookie ``_set_cookie`` set as ``name`` at ``path``: with the attributes it
    was set with (a browser ignores a ``__Host-`` cookie's deletion that is not Secure,
    and Litestar's ``delete_cookie`` sets none)."""
    response.set_cookie(
        cookie_name(request, name),
        "",
        max_age=0,
        expires=0,
        path=cookie_path(request, path),
        httponly=True,
        secure=over_https(request),
    )


def _show_once(request: HubRequest, ui: UI, secret: str, owner: str) -> Response[Any]:
    """Post/Redirect/Get: the secret rides in a short cookie to the GET that shows it, so
    reloading that page neither shows it again nor posts the form again."""
    response: Response[Any] = Redirect(NEW_TOKEN_PATH, status_code=303)
    sealed = ui.sessions.seal_new_token(read_cookie(request, COOKIE), secret, owner)
    _set_cookie(
        response,
        request,
        NEW_TOKEN_COOKIE,
        sealed,
        max_age=None,  # the sealed value expires by itself (NEW_TOKEN_TTL)
        path=NEW_TOKEN_PATH,
    )
    return response


async def _signed_in(ui: UI, hub: Hub, request: HubRequest, form: FormMultiDict | None) -> Viewer:
    """The viewer, who must be signed in; with ``form``, its CSRF token must match."""
    who = await viewer(ui, hub, request)
    if not who.signed_in:
        raise PermissionDeniedException("sign in first")
    if form is not None and not ui.sessions.check_csrf(
        read_cookie(request, COOKIE), _field(form, "csrf", 64)
    ):
        raise PermissionDeniedException("the form expired; reload the page and try again")
    return who


async def _signed_in_with_password(
    ui: UI, hub: Hub, request: HubRequest, form: FormMultiDict
) -> Viewer:
    """``_signed_in``, refusing a session opened with an API token (it may not mint tokens)."""
    who = await _signed_in(ui, hub, request, form)
    if not who.principal.with_password:
        raise PermissionDeniedException("signed in with a token: sign in with your password")
    return who


class AccountController(Controller):
    exception_handlers = HTML_ERRORS
    include_in_schema = False

    # -- sign in / out -------------------------------------------------------
    async def _signin_page(
        self,
        request: HubRequest,
        hub: Hub,
        ui: UI,
        *,
        nxt: str,
        username: str = "",
        error: str = "",
        status: int = 200,
    ) -> Response[str]:
        """The sign-in form, with a fresh login-CSRF cookie and its HMAC in the form."""
        who = await viewer(ui, hub, request)
        nonce = ui.sessions.login_nonce()
        response = ui.renderer.page(
            "signin.html",
            status=status,
            headers=NO_STORE,
            **base_context(ui, hub, request, who),
            error=error,
            next=nxt,
            username=username,
            login_csrf=ui.sessions.login_csrf(nonce),
        )
        _set_cookie(response, request, LOGIN_COOKIE, nonce, max_age=LOGIN_TTL, path=LOGIN_PATH)
        return response

    @get(LOGIN_PATH)
    async def signin_form(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[str]:
        nxt = local_path(request.query_params.get("next"))
        return await self._signin_page(request, hub, ui, nxt=nxt)

    @post(LOGIN_PATH, request_max_body_size=FORM_MAX)
    async def signin(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[Any]:
        form = await _form(request)
        # Login CSRF: the form must come from our own sign-in page in this browser. Checked
        # before the password, so a forged post neither signs anyone in nor counts as a
        # failed login.
        if not ui.sessions.check_login_csrf(
            read_cookie(request, LOGIN_COOKIE), _field(form, "login_csrf", 64)
        ):
            raise PermissionDeniedException(
                "The sign-in form expired or did not come from this site: "
                "open the sign-in page again."
            )
        username, password = _field(form, "username", 64), _field(form, "password", 1024)
        nxt = local_path(_field(form, "next", 1000, cut=True))
        try:
            principal = await login(hub, request, username, password)
        except RegistryError as exc:
            status = 429 if exc.code is Code.TOOMANYREQUESTS else 401
            message = (
                "Too many failed sign-ins; wait a few minutes."
                if status == 429
                else "Wrong user name or password."
            )
            return await self._signin_page(
                request, hub, ui, nxt=nxt, username=username, error=message, status=status
            )
        cookie, row = ui.sessions.issue(principal)
        async with hub.db.transaction() as session:
            await session.run_sync(_open_session, row)
        # Bounded per account (Hub.provoked): a sign-in answers from the credential cache,
        # and one form serves any number of them, so an account signs in at will.
        hub.provoked.record(principal, client_ip(request), "ui.signin", "-", "ok")
        response: Response[Any] = Redirect(nxt, status_code=303)
        _set_cookie(
            response,
            request,
            COOKIE,
            cookie,
            max_age=SESSION_TTL,
            path="/",
            samesite="lax",
        )
        _delete_cookie(response, request, LOGIN_COOKIE, LOGIN_PATH)
        return response

    @post("/-/signout", request_max_body_size=FORM_MAX)
    async def signout(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[Any]:
        # A live session needs the form's CSRF token (another site cannot sign you out);
        # a dead or missing cookie is simply cleared.
        cookie = read_cookie(request, COOKIE)
        who = await ui.sessions.viewer(hub, request)
        claims = ui.sessions.parse(cookie)
        if who.signed_in and claims is not None:
            form = await _form(request)
            if not ui.sessions.check_csrf(cookie, _field(form, "csrf", 64)):
                raise PermissionDeniedException("the form expired; reload the page and try again")
            # Ended on the server: a copy of the cookie opens nothing from now on.
            async with hub.db.transaction() as session:
                await session.execute(delete(UiSession).where(UiSession.id_hash == claims.id_hash))
            hub.provoked.record(who.principal, client_ip(request), "ui.signout", "-", "ok")
        response: Response[Any] = Redirect("/", status_code=303)
        _delete_cookie(response, request, COOKIE, "/")
        return response

    # -- tokens --------------------------------------------------------------
    async def _tokens_page(
        self,
        request: HubRequest,
        hub: Hub,
        ui: UI,
        who: Viewer,
        created: str = "",
        created_for: str = "",
        error: str = "",
        status: int = 200,
        robots_page: int = 1,
    ) -> Response[str]:
        if not who.principal.with_password:  # a token's session lists no tokens
            error = error or "signed in with a token: sign in with your password to manage tokens"
        async with hub.db.reading() as session:
            mine = (
                (
                    await session.scalars(
                        select(ApiToken)
                        .where(ApiToken.user_id == who.principal.user_id)
                        .order_by(ApiToken.id)
                    )
                ).all()
                if who.principal.with_password
                else []
            )
            # Robots hold places in organisations only (members.place_robot).
            namespaces = await queries.admin_namespaces(
                session, who.principal, kind="org", limit=NAMESPACES_LISTED + 1
            )
            robots, more = (
                await session.run_sync(_robots, who.principal, robots_page)
                if who.principal.with_password
                else ([], False)
            )
        if robots_page > 1 and not robots:
            raise NotFoundException(f"no page {robots_page} of robots you manage")
        return ui.renderer.page(
            "tokens.html",
            status=status,
            headers=NO_STORE,
            **base_context(ui, hub, request, who),
            tokens=mine,
            namespaces=namespaces[:NAMESPACES_LISTED],
            # More than the form lists (a site admin administers every organisation):
            # the form takes a typed name, the list only suggests.
            namespaces_more=len(namespaces) > NAMESPACES_LISTED,
            robots=robots,
            robots_prev=_robots_link(robots_page - 1) if robots_page > 1 else "",
            robots_next=_robots_link(robots_page + 1) if more else "",
            robots_page=robots_page,
            created=created,
            created_for=created_for,
            error=error,
            roles=("pull", "push", "admin"),
        )

    @get("/-/settings/tokens")
    async def tokens(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        robots_page: QueryNumber = None,
    ) -> Response[Any]:
        """The viewer's tokens, and one page of the robots they manage (``robots_page``,
        1-100000 in ASCII digits; ``ROBOTS_PER_PAGE`` robots each)."""
        page = query_number(robots_page, "robots_page", 1, PAGES_MAX)
        who = await viewer(ui, hub, request)
        sealed = read_cookie(request, NEW_TOKEN_COOKIE)
        response: Response[Any]
        if not who.signed_in:
            response = Redirect(f"{LOGIN_PATH}?next={NEW_TOKEN_PATH}", status_code=303)
        else:
            # A token created by the POST just before: shown on this page, this once.
            new = ui.sessions.open_new_token(read_cookie(request, COOKIE), sealed)
            created, created_for = new if new is not None else ("", "")
            response = await self._tokens_page(
                request, hub, ui, who, created=created, created_for=created_for, robots_page=page
            )
        if sealed:
            _delete_cookie(response, request, NEW_TOKEN_COOKIE, NEW_TOKEN_PATH)
        return response

    @post(NEW_TOKEN_PATH, request_max_body_size=FORM_MAX)
    async def create_token(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[Any]:
        form = await _form(request)
        who = await _signed_in_with_password(ui, hub, request, form)
        name = _field(form, "name", 64) or "web"
        scopes = _field(form, "scopes", 1000)
        days = _field(form, "expires_days", 8)
        try:
            expires = timedelta(days=parse_count(days, "expiry in days")) if days else None
            if expires is not None and not 1 <= expires.days <= 3650:
                raise InvalidInput("expiry must be 1-3650 days")
            async with hub.db.transaction() as session:
                owner = await accounts.acting_user(session, who.principal)  # by id, not name
                secret = await accounts.create_token(
                    session, owner, name, scopes, expires_in=expires
                )
        except (InvalidInput, Conflict, ValueError, accounts.PrincipalChanged) as exc:
            return await self._tokens_page(request, hub, ui, who, error=str(exc), status=400)
        hub.audit.record(who.principal, client_ip(request), "token.create", name, "ok")
        return _show_once(request, ui, secret, name)

    @post("/-/settings/tokens/{token_id:str}/revoke", request_max_body_size=FORM_MAX)
    async def revoke_token(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        token_id: FromPath[str],
    ) -> Response[Any]:
        number = path_id(token_id, "token id")
        form = await _form(request)
        who = await _signed_in_with_password(ui, hub, request, form)
        async with hub.db.transaction() as session:
            token = await session.get(ApiToken, number)
            allowed = token is not None and token.user_id == who.principal.user_id
            if token is not None and not allowed:
                principal = await accounts.current(session, who.principal)  # 401 if changed
                allowed = await session.run_sync(authz.may_manage_robot, principal, token.user_id)
            if token is None or not allowed:
                raise NotFoundException(f"no token {number}")
            await accounts.revoke_token(session, number)
        hub.audit.record(who.principal, client_ip(request), "token.revoke", str(number), "ok")
        return Redirect(NEW_TOKEN_PATH, status_code=303)

    @post("/-/settings/robots", request_max_body_size=FORM_MAX)
    async def create_robot_token(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[Any]:
        """A token for a robot account that is a member of a namespace the viewer admins."""
        form = await _form(request)
        who = await _signed_in_with_password(ui, hub, request, form)
        ns_name, robot, role = (
            _field(form, "namespace"),
            _field(form, "robot", 64),
            _field(form, "role", 8),
        )
        try:
            accounts.validate_account(robot)  # ci, or acme+ci (members.place_robot)
            if role not in ROLES:
                raise InvalidInput("role must be pull, push or admin")
            async with hub.db.transaction() as session:
                # The API's member change (hub/members.py), for a robot it may make first:
                # who the viewer is now (PrincipalChanged, 401), their admin right, only
                # organisations, another namespace's robot refused, the last admin kept.
                user = await members.place_robot(session, who.principal, ns_name, robot, role)
                secret = await accounts.create_token(
                    # A label the hub makes (a namespace name has up to 255 characters).
                    session,
                    user,
                    f"{ns_name}-{role}"[-accounts.TOKEN_NAME_MAX :],
                    f"{ns_name}:{role}",
                    minted_by=who.principal.user_id,
                )
        except (InvalidInput, Conflict, members.NotPermitted) as exc:
            return await self._tokens_page(request, hub, ui, who, error=str(exc), status=400)
        hub.audit.record(who.principal, client_ip(request), "robot.token", user.name, "ok")
        return _show_once(request, ui, secret, user.name)

    # -- team membership -----------------------------------------------------
    @post("/-/members/{namespace:str}", request_max_body_size=FORM_MAX)
    async def set_member(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        namespace: FromPath[str],
    ) -> Response[Any]:
        form = await _form(request)
        who = await _signed_in(ui, hub, request, form)
        username, role = _field(form, "username", 64), _field(form, "role", 8)
        try:
            accounts.validate_namespace(namespace)
            accounts.validate_account(username)
        except InvalidInput as exc:
            raise NotFoundException(str(exc)) from exc
        try:
            async with hub.db.transaction() as session:
                # The hub API's rules, from the one member service (hub/members.py).
                await members.change_member(
                    session, who.principal, namespace, username, None if role == "remove" else role
                )
        except members.NotPermitted as exc:
            raise PermissionDeniedException(str(exc)) from exc
        except members.NoMembers as exc:
            raise ValidationException(str(exc)) from exc
        except InvalidInput as exc:
            raise NotFoundException(str(exc)) from exc
        except Conflict as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        hub.audit.record(
            who.principal, client_ip(request), "member.set", f"{namespace}/{username}", role
        )
        return Redirect(f"/{namespace}", status_code=303)

    # -- README and description ----------------------------------------------
    @post("/-/edit/{name:path}", request_max_body_size=FORM_MAX)
    async def edit_readme(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        name: FromPath[str],
    ) -> Response[Any]:
        form = await _form(request)
        who = await _signed_in(ui, hub, request, form)
        name = name.strip("/")
        readme = _field(form, "readme", README_MAX)
        description = _field(form, "description", DESCRIPTION_MAX)
        try:
            check_text(readme, description)  # what is wrong with the text: 400, saying so
        except InvalidInput as exc:
            raise ValidationException(str(exc)) from exc
        try:
            validate_name(name)
            async with hub.db.transaction() as session:
                await set_text(session, who.principal, name, readme=readme, description=description)
        except InvalidInput as exc:  # no repository the caller may push to: no hint
            raise NotFoundException(str(exc)) from exc
        hub.audit.record(who.principal, client_ip(request), "repo.readme", name, "ok")
        return Redirect(f"/{name}", status_code=303)


def _robots_link(page: int) -> str:
    return NEW_TOKEN_PATH + (f"?{urlencode({'robots_page': page})}" if page > 1 else "")


def _open_session(session: Session, row: UiSession) -> None:
    """Store a new session row, ending the oldest sessions of the same credential beyond
    ``SESSIONS_PER_USER`` (and the user's that ran out). Sign-in answers from the
    credential cache without an argon2 check, so without a bound one account could add
    rows as fast as it sends forms, each kept for 12 h. Counted per credential (the
    password, or one API token: at most ``MAX_TOKENS_PER_USER + 1`` of them per account),
    not per account: counted together, whoever held a pull-only token of the account (a CI
    job's, a robot's) signed in 20 times and so signed its owner out of every browser.
    The user's row is locked (PostgreSQL), so sign-ins racing each other cannot each keep
    one more."""
    session.scalars(select(User.id).where(User.id == row.user_id).with_for_update()).first()
    session.execute(
        delete(UiSession).where(UiSession.user_id == row.user_id, UiSession.expires_at < utcnow())
    )
    same_credential = and_(
        UiSession.user_id == row.user_id,
        UiSession.token_id.is_(None)
        if row.token_id is None
        else UiSession.token_id == row.token_id,
    )
    kept = (
        select(UiSession.id_hash)
        .where(same_credential)
        .order_by(UiSession.created_at.desc(), UiSession.id_hash)
        .limit(SESSIONS_PER_USER - 1)
    )
    session.execute(
        delete(UiSession).where(same_credential, UiSession.id_hash.not_in(kept.scalar_subquery()))
    )
    session.add(row)


@dataclass
class RobotToken:
    token: ApiToken
    minted_by: str  # who minted it for the robot ("": not recorded: the operator's, or older)
    stands: bool  # False: its minter may no longer manage the robot (authz.minter_stands)


@dataclass
class RobotRow:
    user_id: int
    name: str
    tokens: list[RobotToken]


# Organisations the robot form offers by name (a site admin's are every organisation of
# the hub, 20 per user); past them the form takes a typed name.
NAMESPACES_LISTED = 100
# Robots one view of the tokens page lists (with all their tokens, at most
# ``MAX_TOKENS_PER_USER`` each); ``robots_page`` picks the others.
ROBOTS_PER_PAGE = 20


def _robots(
    session: Session, principal: accounts.Principal, page: int
) -> tuple[list[RobotRow], bool]:
    """One page of the robots ``principal`` manages (``authz.manageable_robots``, by name)
    with their tokens, who minted each and whether it still works; and whether more
    follow. A bounded number of reads whatever the number of robots: the page's tokens
    and their minters in one query each, each minter's right checked once per robot
    (``authz.minter_stands``: every token was a check of three reads, and the page
    listed every robot). Sync ORM code."""
    found = authz.manageable_robots(
        session, principal, offset=(page - 1) * ROBOTS_PER_PAGE, limit=ROBOTS_PER_PAGE + 1
    )
    more = len(found) > ROBOTS_PER_PAGE
    shown = found[:ROBOTS_PER_PAGE]
    tokens = session.scalars(
        select(ApiToken)
        .where(ApiToken.user_id.in_([robot.id for robot in shown]))
        .order_by(ApiToken.id)
    ).all()
    minter_ids = {t.minted_by for t in tokens if t.minted_by is not None}
    minters = {
        user_id: name
        for user_id, name in session.execute(
            select(User.id, User.name).where(User.id.in_(minter_ids))
        )
    }
    stands: dict[tuple[int | None, int], bool] = {}
    by_robot: dict[int, list[RobotToken]] = {robot.id: [] for robot in shown}
    for token in tokens:
        key = (token.minted_by, token.user_id)  # one check per minter and robot
        if key not in stands:
            stands[key] = authz.minter_stands(session, token)
        named = minters.get(token.minted_by, "a removed account") if token.minted_by else ""
        by_robot[token.user_id].append(RobotToken(token, named, stands[key]))
    return [RobotRow(r.id, r.name, by_robot[r.id]) for r in shown], more
