"""Request authentication and the registry token flow.

Clients send either ``Authorization: Basic`` (user + password, or user + API
token) or ``Authorization: Bearer`` with a short-lived token from ``GET /token``
(the registry token spec: Basic credentials or none in, ``{"token": …}`` out).
Bearer tokens are HMAC-SHA256-signed JSON: subject, API token id, granted access,
expiry. At each request the subject's rights are re-read from the database, so a
removed user or token stops working at once.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import time
from dataclasses import dataclass, replace

from litestar import Request, Response, get
from litestar.datastructures import State
from litestar.di import NamedDependency
from sqlalchemy import select
from sqlalchemy.orm import Session

from forkd.errors import InvalidInput
from forkd.hub import accounts, authz
from forkd.hub.accounts import ANONYMOUS, Principal
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Repository, User
from forkd.hub.services import Hub, limited_address
from forkd.hub.settings import Network, host_names, parse_host, proxy_networks
from forkd.hub.tokens import Grant
from forkd.names import is_account_name, shown, validate_name

SCOPE_RE = re.compile(r"\Arepository:([^:]+):([a-z*,]+)\Z")  # whole text, even with .match
REQUESTABLE = frozenset({"pull", "push", "delete", "*"})
MAX_TOKEN_REPOSITORIES = 64  # repositories one /token request may name (``_requested``)
# Every answer that carries a credential (RFC 6749 5.1): never kept by a cache.
SECRET_HEADERS = {"Cache-Control": "no-store", "Pragma": "no-cache"}


# -- per-request authentication ------------------------------------------------
@dataclass(frozen=True)
class Caller:
    principal: Principal
    grant: Grant | None  # set when authenticated by a bearer token


def client_ip(request: Request[object, object, State]) -> str:
    """The client's address: the peer's, or, when the peer is one of the configured
    ``trusted_proxies``, the nearest address in X-Forwarded-For that is not a trusted
    proxy. From anyone else the header is ignored, so it cannot pick an address."""
    peer = request.client.host if request.client else "unknown"
    hub: Hub = request.app.state.hub
    trusted = proxy_networks(hub.settings.trusted_proxies)
    if not trusted or not _within(peer, trusted):
        return peer
    hops = [h.strip() for v in request.headers.getall("x-forwarded-for", []) for h in v.split(",")]
    for hop in reversed(hops):
        if not _within(hop, trusted):
            return hop if _is_ip(hop) else peer
    return peer


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _within(address: str, networks: tuple[Network, ...]) -> bool:
    """Whether ``address`` is in one of ``networks``; an IPv4-mapped IPv6 address
    (``::ffff:10.0.0.5``: a dual-stack listener's peer, or a proxy's hop written so) is
    its IPv4 address, so a trusted proxy is trusted however the address is written."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)


def _basic(header: str) -> tuple[str, str] | None:
    """(user, password) of a Basic credential; None when it is not one. ``header`` is
    the client's text: one that is not ASCII is ``b64decode``'s ValueError, not a 500."""
    if not header.isascii():
        return None
    try:
        raw = base64.b64decode(header, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = raw.partition(":")
    return (user, password) if sep else None


def check_host(hub: Hub, request: Request[object, object, State]) -> None:
    """Every request (the app's ``before_request``): its Host header is a host name, an
    IP address or an IPv6 literal with an optional port (``parse_host``: no user info,
    path or quote) and, when ``allowed_hosts`` is set, one of them (an entry without a
    port takes any port); else 400. The token realm (``realm``) and the UI's pull
    commands follow the Host when ``public_url`` is not set, so no response names a
    host the operator did not list, or a URL that is not just a host. A request without
    a Host (HTTP/1.0), or with an empty one, gets the server's own address."""
    host = request.headers.get("host")
    if not host:
        return
    allowed = host_names(hub.settings.allowed_hosts)
    parsed = parse_host(host)
    if parsed is not None:
        if not allowed or not allowed.isdisjoint(parsed):  # HOST:PORT, or HOST for any port
            return
        why = "is not one of the names this hub serves (allowed_hosts)"
    else:
        why = "is not a host name, IP address or [IPv6] with an optional :PORT"
    raise RegistryError(
        Code.UNSUPPORTED,
        f"Host header {shown(host)} {why}: connect to the hub by its name (the one in "
        "its public URL), or ask its operator to list this one in allowed_hosts",
        status=400,
    )


def realm(hub: Hub, request: Request[object, object, State]) -> str:
    """The token endpoint's URL: ``public_url``'s, else the request's own base (its Host
    was checked by ``check_host``)."""
    base = hub.settings.public_url or str(request.base_url).rstrip("/")
    return f"{base}/token"


def challenge(
    hub: Hub, request: Request[object, object, State], scope: str = "", error: str = ""
) -> RegistryError:
    value = f'Bearer realm="{realm(hub, request)}",service="{hub.settings.service}"'
    if scope:
        value += f',scope="{scope}"'
    if error:
        value += f',error="{error}"'
    return RegistryError(Code.UNAUTHORIZED, headers={"WWW-Authenticate": value})


def logged_name(user: str) -> str:
    """What the audit log records as the actor of a refused login: the name when it is one
    an account could have, else ``(not a user name)``. The field is the client's: a token
    pasted as the user name (``fkd_…``, 47 characters), or a password typed there, would
    otherwise be kept in clear in the append-only log that operators ship and share."""
    if is_account_name(user) and not user.startswith(accounts.TOKEN_PREFIX):
        return user
    return "(not a user name)"


async def login(
    hub: Hub, request: Request[object, object, State], user: str, password: str
) -> Principal:
    """Check Basic credentials, counting failures; raise 429 or 401 on refusal."""
    host = client_ip(request)
    cache_key = hub.verified.key(user, password)
    cached = hub.verified.get(cache_key)
    if cached is not None:
        again = await hub.db.read(accounts.token_principal, *cached)
        if again is not None:
            return again
        hub.verified.drop(cache_key)  # removed, revoked or password changed since
    if password.startswith(accounts.TOKEN_PREFIX):
        # API tokens are 256 random bits, checked by one indexed lookup: nothing to guess,
        # so the password limiter neither throttles nor counts them.
        return await _login_with_token(hub, host, user, password, cache_key)
    # Counted per client address only: a count per user name would let anyone lock
    # someone else out (docs/hub.md, "Security model").
    keys = [f"ip:{limited_address(host)}"]
    # Counted as a failure until it is not: concurrent guesses cannot all pass the check.
    # The limiter tags the credential with an HMAC under the hub's shared key (one tag on
    # every replica); the cache's key is salted per process and would differ.
    wait, attempt = await hub.limiter.attempt(keys, f"{user}\x00{password}")
    if wait:
        hub.provoked.record(logged_name(user), host, "login", "-", "rate-limited")
        raise RegistryError(
            Code.TOOMANYREQUESTS,
            "too many failed logins; try again later",
            headers={"Retry-After": str(wait)},
        )
    async with hub.db.reading() as session:
        principal = await accounts.authenticate_password(session, user, password)
    if principal is None:
        await hub.limiter.failed(attempt)
        hub.metrics.auth_failures.inc()
        hub.provoked.record(logged_name(user), host, "login", "-", "denied")
        raise RegistryError(Code.UNAUTHORIZED, "invalid user name, password or token")
    await hub.limiter.succeeded(attempt)
    hub.verified.put(principal, cache_key)
    return principal


async def _login_with_token(
    hub: Hub, host: str, user: str, secret: str, cache_key: str
) -> Principal:
    async with hub.db.reading() as session:
        principal = await accounts.authenticate_password(session, user, secret)
    if principal is None:
        hub.metrics.auth_failures.inc()
        hub.provoked.record(logged_name(user), host, "login", "-", "denied")
        raise RegistryError(Code.UNAUTHORIZED, "invalid user name, password or token")
    hub.verified.put(principal, cache_key)
    return principal


async def authenticate(hub: Hub, request: Request[object, object, State]) -> Caller:
    """Who sent this request. Bad credentials → 401 (or 429 when rate-limited)."""
    header = request.headers.get("authorization", "")
    kind, _, value = header.partition(" ")
    kind = kind.lower()
    if not header:
        return Caller(ANONYMOUS, None)
    if kind == "basic":
        creds = _basic(value.strip())
        if creds is None:
            raise challenge(hub, request, error="invalid_request")
        return Caller(await login(hub, request, *creds), None)
    if kind == "bearer":
        grant = hub.signer.verify(value.strip())
        if grant is None:
            hub.metrics.auth_failures.inc()
            raise challenge(hub, request, error="invalid_token")
        if grant.user_id is None:
            return Caller(ANONYMOUS, grant)
        principal = await hub.db.read(
            accounts.token_principal, grant.user_id, grant.token_id, grant.stamp
        )
        if principal is None:
            raise challenge(hub, request, error="invalid_token")
        # The bearer's access narrows the principal wherever it is used (authz), not only
        # on the /v2/<name>/ routes.
        return Caller(replace(principal, bearer_access=grant.access), grant)
    raise challenge(hub, request, error="invalid_request")


async def authorize(
    hub: Hub, request: Request[object, object, State], caller: Caller, repository: str, action: str
) -> Repository | None:
    """Raise unless ``caller`` may do ``action`` on ``repository``; return the repository
    as read for the check (None if it does not exist yet), so handlers need not read it again.

    Anonymous callers get the 401 challenge; a bearer token that lacks an
    action its subject holds gets 403 with a challenge naming the scope to ask
    for (RFC 6750 insufficient_scope); otherwise a repository the caller cannot
    see is NAME_UNKNOWN (404) and one it can see is DENIED (403).
    """
    repo, held = await hub.db.read(authz.access, caller.principal, repository)
    permit(hub, request, caller, repository, action, held)
    return repo


def permit(
    hub: Hub,
    request: Request[object, object, State],
    caller: Caller,
    repository: str,
    action: str,
    held: frozenset[str],
) -> None:
    """The decision half of ``authorize``, for handlers that read ``authz.access``
    together with what they serve: raise unless ``action`` is in ``held`` (as narrowed by
    the caller's bearer token)."""
    granted = held
    if caller.grant is not None:
        granted = held & caller.grant.access.get(repository, frozenset())
    if action in granted:
        return
    hub.provoked.record(caller.principal, client_ip(request), action, repository, "denied")
    scope_actions = "pull" if action == "pull" else f"pull,{action}"
    scope = f"repository:{repository}:{scope_actions}"
    if caller.principal.anonymous:
        raise challenge(hub, request, scope)
    if caller.grant is not None and action in held:
        # RFC 6750 §3.1: a token short of scope is 403 with a challenge naming the scope.
        error = challenge(hub, request, scope, "insufficient_scope")
        raise RegistryError(
            Code.DENIED, f"token lacks {action} on {repository}", headers=error.headers
        )
    if "pull" in held:
        raise RegistryError(Code.DENIED, f"{action} access to {repository} is denied")
    raise RegistryError(Code.NAME_UNKNOWN, f"repository {repository} not found")


def rights_now(
    session: Session, caller: Caller, repository: str, *, hold: bool = False
) -> frozenset[str] | None:
    """The actions ``caller`` holds on ``repository`` now, narrowed by its bearer token's
    grant as ``permit`` narrows them; None when its principal is gone or no longer the
    same (user removed, token revoked or expired, password changed: re-resolved by id and
    stamp, ``accounts.token_principal``). ``authorize`` answered when a request began; a
    request that runs on (an upload, a download, a compaction) asks again with this.
    ``hold``: in the write transaction that makes a change, hold the user row ``FOR
    SHARE`` (PostgreSQL) so a removal waits for the commit. Sync ORM code."""
    principal = caller.principal
    if not principal.anonymous:
        query = select(User.id).where(User.id == principal.user_id)
        held_row = session.scalars(query.with_for_update(read=True) if hold else query).first()
        fresh = (
            accounts.token_principal(session, held_row, principal.token_id, principal.stamp)
            if held_row is not None
            else None
        )
        if fresh is None:
            return None
        principal = replace(fresh, bearer_access=principal.bearer_access)
    _, held = authz.access(session, principal, repository)
    if caller.grant is not None:
        return held & caller.grant.access.get(repository, frozenset())
    return held


def withdrawn(
    caller: Caller, repository: str, action: str, granted: frozenset[str] | None, outcome: str
) -> RegistryError | None:
    """The refusal for a request whose caller held ``action`` on ``repository`` when it
    began and holds ``granted`` now (``rights_now``), None while ``action`` is still
    granted. ``outcome`` says what became of the request ("nothing was stored"). The
    caller was told the repository exists when the request began, so losing it is 403
    DENIED, not the 404 an outsider gets; a principal that is gone is 401."""
    if granted is None:
        return RegistryError(
            Code.UNAUTHORIZED,
            "your account was removed, or its password or token changed, while this "
            f"request ran; {outcome}: sign in again",
        )
    if action in granted:
        return None
    return RegistryError(
        Code.DENIED,
        f"{action} access to {repository} was withdrawn while this request ran; {outcome}",
    )


def still_permitted(session: Session, caller: Caller, repository: str, action: str) -> None:
    """Inside the write transaction that makes a request's change: raise unless the
    caller still holds ``action`` on ``repository`` now (``rights_now``, holding the
    user row), however long the request took since ``authorize``. Sync ORM code
    (``Database.write`` or ``run_sync``)."""
    granted = rights_now(session, caller, repository, hold=True)
    refusal = withdrawn(caller, repository, action, granted, "nothing was stored")
    if refusal is not None:
        raise refusal


async def still_allowed(
    hub: Hub, caller: Caller, repository: str, action: str, outcome: str
) -> None:
    """``still_permitted`` for a request that streams (a blob download, an upload's
    body): one short read transaction per call (``Database.read``), no session or
    connection held between calls. Raise the refusal (``withdrawn``) when ``action`` is
    no longer the caller's."""
    granted = await hub.db.read(rights_now, caller, repository)
    refusal = withdrawn(caller, repository, action, granted, outcome)
    if refusal is not None:
        raise refusal


def _requested(scopes: list[str]) -> dict[str, frozenset[str]]:
    """The repositories and actions a ``/token`` request asks for; 400 past
    ``MAX_TOKEN_REPOSITORIES`` repositories (a token is sent back on every request: one
    naming a thousand repositories is 180 kB, past every proxy's header limit, and each
    one is an authorisation read and an audit-log entry)."""
    wanted: dict[str, frozenset[str]] = {}
    for scope in scopes:
        for item in scope.split(" "):
            m = SCOPE_RE.fullmatch(item)
            if not m:
                continue  # unknown scope types (registry:catalog:*) are granted nothing
            try:
                name = validate_name(m.group(1))
            except InvalidInput:
                continue
            actions = frozenset(m.group(2).split(",")) & REQUESTABLE
            if "*" in actions:
                actions = authz.ALL_ACTIONS
            wanted[name] = wanted.get(name, frozenset()) | actions
            if len(wanted) > MAX_TOKEN_REPOSITORIES:
                raise _too_many_scopes()
    return wanted


def _too_many_scopes() -> RegistryError:
    return RegistryError(
        Code.UNSUPPORTED,
        f"a token names at most {MAX_TOKEN_REPOSITORIES} repositories (scope "
        "repository:NAME:ACTIONS): ask for the ones this operation needs, or use Basic "
        "credentials on each request",
        status=400,
    )


@get("/token")
async def token_endpoint(
    request: Request[object, object, State], hub: NamedDependency[Hub]
) -> Response[object]:
    """Registry token endpoint: Basic credentials (or none) in, a bearer token out."""
    caller = await authenticate(hub, request)
    if caller.grant is not None:
        raise RegistryError(Code.UNAUTHORIZED, "use Basic credentials to obtain a token")
    service = request.query_params.get("service")
    if service is not None and service != hub.settings.service:
        raise RegistryError(Code.DENIED, f"unknown service {shown(service)}")
    wanted = _requested(request.query_params.getall("scope", []))
    held = await hub.db.read(authz.repository_actions, caller.principal, list(wanted))  # one read
    access = {name: wanted[name] & held[name] for name in wanted if wanted[name] & held[name]}
    token, issued = hub.signer.issue(caller.principal, access)
    # Bounded in the log, per caller: anyone may ask for tokens at will (Hub.provoked).
    hub.provoked.record(
        caller.principal,
        client_ip(request),
        "token",
        " ".join(sorted(access)) or "-",
        "ok",
        granted={name: sorted(actions) for name, actions in access.items()},
    )
    issued_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(issued))
    return Response(
        {
            "token": token,
            "access_token": token,
            "expires_in": hub.signer.ttl,
            "issued_at": issued_at,
        },
        headers=SECRET_HEADERS,
    )
