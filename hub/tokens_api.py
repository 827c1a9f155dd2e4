"""Hub API ``/api/v1/tokens``: a user lists, creates and revokes their own API tokens.

Creating a token needs the account's password (Basic): neither an API token nor a
registry bearer token (a short-lived credential for the repositories it names) mints
one. A token never grants more than its user holds (its scopes only narrow), so a user
may name any namespace in its scopes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.exceptions import (
    HTTPException,
    NotAuthorizedException,
    NotFoundException,
    PermissionDeniedException,
    ValidationException,
)
from litestar.params import FromPath, JSONBody
from sqlalchemy import select

from forkd.bodies import Body
from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts
from forkd.hub.auth import SECRET_HEADERS, authenticate, client_ip
from forkd.hub.display import one_line
from forkd.hub.models import ApiToken
from forkd.hub.params import path_id
from forkd.hub.services import Hub


@dataclass
class TokenInfo:
    id: int
    name: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None


class TokenCreate(Body):
    # The column's length: a longer name is refused (400), never stored cut short.
    name: Annotated[str, msgspec.Meta(max_length=accounts.TOKEN_NAME_MAX)]
    scopes: list[str]
    expires_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] | None = None


@dataclass
class TokenCreated(TokenInfo):
    token: str  # shown once


async def _user(hub: Hub, request: Request[object, object, State]) -> accounts.Principal:
    """The signed-in caller, by any credential (orgs_api narrows what a token may do)."""
    principal = (await authenticate(hub, request)).principal
    if principal.anonymous:
        raise NotAuthorizedException("log in with your user name and password")
    return principal


async def _owner(hub: Hub, request: Request[object, object, State]) -> accounts.Principal:
    """The user managing their tokens, authenticated by the password: an API token or a
    registry bearer token lists, creates and revokes nothing (a pull-only token must not
    read the names and scopes of the others, or revoke the deploy token)."""
    principal = await _user(hub, request)
    if not principal.with_password:
        raise PermissionDeniedException(
            "an API token or registry bearer token cannot manage tokens; use the password"
        )
    return principal


def _info(token: ApiToken) -> TokenInfo:
    """What a listing says of ``token``: its name and scopes as one line each, escapes
    visible (a row stored before the checks: ``display.one_line``)."""
    return TokenInfo(
        token.id,
        one_line(token.name),
        [one_line(scope) for scope in token.scopes.split()],
        token.created_at,
        token.expires_at,
    )


class TokenController(Controller):
    path = "/api/v1/tokens"

    @get("/")
    async def list_tokens(
        self, request: Request[object, object, State], hub: NamedDependency[Hub]
    ) -> list[TokenInfo]:
        principal = await _owner(hub, request)
        async with hub.db.reading() as session:
            rows = await session.scalars(
                select(ApiToken).where(ApiToken.user_id == principal.user_id).order_by(ApiToken.id)
            )
            return [_info(t) for t in rows.all()]

    @post("/", response_headers=SECRET_HEADERS)
    async def create_token(
        self,
        request: Request[object, object, State],
        hub: NamedDependency[Hub],
        data: JSONBody[TokenCreate],
    ) -> TokenCreated:
        principal = await _owner(hub, request)
        try:
            async with hub.db.transaction() as session:
                secret = await accounts.create_token(
                    session,
                    await accounts.acting_user(session, principal),  # by id, never by name
                    data.name,
                    " ".join(data.scopes),
                    expires_in=timedelta(days=data.expires_days) if data.expires_days else None,
                )
                token = (
                    await session.scalars(
                        select(ApiToken).where(ApiToken.token_hash == accounts.hash_token(secret))
                    )
                ).one()
        except accounts.PrincipalChanged as exc:
            raise NotAuthorizedException(str(exc)) from exc
        except InvalidInput as exc:
            raise ValidationException(str(exc)) from exc
        except Conflict as exc:  # MAX_TOKENS_PER_USER
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        hub.audit.record(
            principal,
            client_ip(request),
            "token.create",
            token.name,
            "ok",
            scopes=token.scopes.split(),
        )
        info = _info(token)
        return TokenCreated(**info.__dict__, token=secret)

    @delete("/{token_id:str}")
    async def revoke_token(
        self,
        request: Request[object, object, State],
        hub: NamedDependency[Hub],
        token_id: FromPath[str],
    ) -> None:
        """Revoke one of the caller's tokens by its id (ASCII digits, as the list shows
        it: ``path_id``)."""
        number = path_id(token_id, "token id")
        principal = await _owner(hub, request)
        async with hub.db.transaction() as session:
            token = await session.get(ApiToken, number)
            if token is None or token.user_id != principal.user_id:
                raise NotFoundException(f"no token {number}")
            await accounts.revoke_token(session, number)
        hub.audit.record(principal, client_ip(request), "token.revoke", str(number), "ok")
