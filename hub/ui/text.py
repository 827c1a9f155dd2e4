"""A repository's README and description: the one place they are checked and written."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from forkd.errors import InvalidInput
from forkd.hub import accounts, authz
from forkd.hub.models import Repository
from forkd.hub.ui.render import README_MAX
from forkd.names import validate_line

DESCRIPTION_MAX = 300


def check_text(readme: str | None, description: str | None) -> None:
    if readme is not None and len(readme.encode()) > README_MAX:
        raise InvalidInput(f"README is over {README_MAX // 1024} KiB")
    if description is not None:
        if len(description) > DESCRIPTION_MAX:
            raise InvalidInput(f"description must be at most {DESCRIPTION_MAX} characters")
        # One line, shown in every listing of the pack: no line break, escape sequence or
        # bidi override of the pusher's reaches a reader's terminal or reorders the page.
        validate_line(description, "a description")
    for text in (readme, description):
        if text is not None and "\x00" in text:
            raise InvalidInput("README and description cannot contain NUL characters")


async def set_text(
    session: AsyncSession,
    principal: accounts.Principal,
    name: str,
    *,
    readme: str | None = None,
    description: str | None = None,
) -> Repository:
    """Set what is given (None: keep). Needs push on the repository; NotFound-like
    InvalidInput when the caller may not see or change it (no hint that it exists)."""
    check_text(readme, description)
    principal = await accounts.current(session, principal)  # PrincipalChanged: 401
    actions = await session.run_sync(authz.repository_access, principal, name)
    repo = actions[0]
    if repo is None or "push" not in actions[1]:
        raise InvalidInput(f"no repository {name} that you may push to")
    if readme is not None:
        repo.readme = readme
    if description is not None:
        repo.description = description.strip()
    return repo
