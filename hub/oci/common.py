"""What every OCI resource handler shares: the request context, repositories, blob links."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from itertools import islice

import anyio
from litestar import Request
from litestar.datastructures import State
from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd import digest as dg
from forkd.errors import Conflict, InvalidInput
from forkd.hub import accounts, quotas
from forkd.hub.accounts import Principal
from forkd.hub.auth import (
    Caller,
    authorize,
    client_ip,
    permit,
    still_allowed,
    still_permitted,
)
from forkd.hub.db import SQLITE_BUSY_TIMEOUT_S, Database
from forkd.hub.db import _busy as database_busy
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Repository, RepositoryBlob, utcnow
from forkd.hub.services import Hub
from forkd.names import shown

HubRequest = Request[object, object, State]
STREAM_CHUNK = 1 << 20
# Digests per ``IN (...)`` query: well under SQLite's and asyncpg's bound-parameter limits.
IN_CHUNK = 500
# What a client is told to wait after the database stayed locked (503 + Retry-After).
RETRY_AFTER_S = 2
# A number a client sends (header or query): ASCII digits only (``str.isdigit`` takes
# '²', which ``int`` refuses). An exact count (a length, a chunk's range) has at most 19
# of them (``int`` refuses past 4300 digits, and a byte count past a signed 64-bit
# integer is never meaningful); a bound (a page size, a Range position) may have any
# number, and one past 64 bits means "more than there is" (``parse_bound``).
COUNT_RE = re.compile(r"[0-9]{1,19}", re.ASCII)
DIGITS_RE = re.compile(r"[0-9]+", re.ASCII)
MAX_COUNT = (1 << 63) - 1
# How often a request that streams (a blob download, an upload's body) asks again whether
# its caller still holds the right it began with (``RightsCheck``), in seconds.
RIGHTS_RECHECK_S = 5.0


@dataclass
class Ctx:
    """One registry request: the hub, the request, who sent it, the repository name."""

    hub: Hub
    request: HubRequest
    caller: Caller
    name: str
    checked: Repository | None = None  # as read by ``allow`` (detached, read-only use)

    async def allow(self, action: str) -> None:
        self.checked = await authorize(self.hub, self.request, self.caller, self.name, action)

    def permit(self, action: str, repo: Repository | None, held: frozenset[str]) -> None:
        """``allow`` for a handler that read ``authz.access`` itself (``repo``, ``held``)."""
        permit(self.hub, self.request, self.caller, self.name, action, held)
        self.checked = repo

    def still(self, session: Session, action: str) -> None:
        """In the write transaction that makes this request's change: ``action`` is still
        the caller's (``auth.still_permitted``), however long the request took since
        ``allow``. Sync ORM code."""
        still_permitted(session, self.caller, self.name, action)

    async def still_async(self, session: AsyncSession, action: str) -> None:
        """``still`` from an async session."""
        await session.run_sync(self.still, action)

    def known(self) -> Repository:
        """The repository as ``allow`` read it; NAME_UNKNOWN when it does not exist."""
        if self.checked is None:
            raise RegistryError(Code.NAME_UNKNOWN, f"repository {self.name} not found")
        return self.checked

    async def repository(self, session: AsyncSession) -> Repository:
        """The existing repository (after ``allow``, re-read in ``session`` if it was
        created since), else NAME_UNKNOWN."""
        if self.checked is None:
            self.checked = await accounts.get_repository(session, self.name)
        return self.known()

    async def repository_for_push(self, session: AsyncSession) -> Repository:
        """The repository, created on first push (after ``allow("push")``)."""
        repo = await accounts.get_repository(session, self.name)
        if repo is not None:
            return repo
        try:
            # A savepoint: on PostgreSQL a concurrent first push may create it first.
            async with session.begin_nested():
                return await accounts.create_repository(
                    session,
                    self.name,
                    public=self.hub.settings.default_visibility == "public",
                    admin_may_create_namespace=creates_namespaces(self.caller.principal),
                    most=self.hub.settings.repositories_max,
                )
        except InvalidInput as exc:
            raise RegistryError(Code.NAME_UNKNOWN, str(exc)) from exc
        except Conflict as exc:  # the namespace's name is an account's (accounts.claim_name)
            raise RegistryError(Code.DENIED, str(exc), message=str(exc)) from exc
        except sa_exc.IntegrityError:
            repo = await accounts.get_repository(session, self.name)
            if repo is None:
                raise
            return repo

    def audit(self, action: str, target: str, result: str = "ok", **detail: object) -> None:
        """Record a write in the audit log (who, from where, what, on which repository);
        a refusal or failure, which the caller may provoke at will, within the bounds of
        ``Hub.provoked``."""
        log = self.hub.audit if result == "ok" else self.hub.provoked
        log.record(
            self.caller.principal,
            client_ip(self.request),
            action,
            f"{self.name}@{target}" if target else self.name,
            result,
            **detail,
        )

    def url(self, suffix: str) -> str:
        return f"/v2/{self.name}/{suffix}"


def creates_namespaces(principal: Principal) -> bool:
    """Whether a push by ``principal`` into a namespace that does not exist creates it: a
    site admin acting as one (``Principal.site_admin``: the password, or an API token of
    scope ``*:admin``), also through a registry bearer token of theirs, which narrows to
    its repositories but is how registry clients push. A site admin's token of a lower
    scope (``*:push``: a CI job's) pushes where namespaces exist and creates none."""
    return replace(principal, bearer_access=None).site_admin


class RightsCheck:
    """The caller's right to ``action`` on the request's repository, asked again while a
    request streams: ``authorize`` answered when it began, and a download or an upload's
    body can run for hours after that. Calling it is free until ``RIGHTS_RECHECK_S``
    seconds have passed since the last answer; then it reads the rights again
    (``auth.still_allowed``: a short read transaction, nothing held in between) and
    raises 401 UNAUTHORIZED (the account removed, its password or the token changed) or
    403 DENIED (the right withdrawn) when they are gone. ``outcome`` is what the refusal
    says became of the request. A registry bearer token's expiry does not cut a request
    that began with it: only what its subject lost."""

    def __init__(self, ctx: Ctx, action: str, outcome: str) -> None:
        self.ctx, self.action, self.outcome = ctx, action, outcome
        self.interval = RIGHTS_RECHECK_S
        self.due = time.monotonic() + self.interval

    async def __call__(self) -> None:
        if time.monotonic() < self.due:
            return
        ctx = self.ctx
        await still_allowed(ctx.hub, ctx.caller, ctx.name, self.action, self.outcome)
        self.due = time.monotonic() + self.interval

    def until_due(self) -> float:
        """Seconds until the next check is due (0 when it is)."""
        return max(0.0, self.due - time.monotonic())


class _Body:
    """A request body read by a task of its own, at most one chunk ahead of its reader
    (``checked_body``). The chunk waits in ``item`` (not in a stream whose receive could
    be cancelled after taking it), so the reader may stop waiting for a check and lose
    nothing."""

    def __init__(self) -> None:
        self.item: bytes | None = None
        self.ended = False
        self.error: Exception | None = None  # what ended the body (a client gone away)
        self.arrived = anyio.Event()
        self.taken = anyio.Event()

    async def pump(self, source: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in source:
                self.item = chunk
                self.arrived.set()
                await self.taken.wait()
                self.taken = anyio.Event()
        except Exception as exc:  # raised in the reader's task, where it is handled
            self.error = exc
        self.ended = True
        self.arrived.set()

    async def next(self, check: RightsCheck) -> bytes | None:
        while self.item is None and not self.ended:
            with anyio.move_on_after(check.until_due()):
                await self.arrived.wait()
            if self.item is None and not self.ended:
                await check()  # the sender is silent: is it still allowed to send?
        if self.item is not None:
            chunk, self.item = self.item, None
            self.arrived = anyio.Event()
            self.taken.set()
            return chunk
        if self.error is not None:
            raise self.error
        return None


@asynccontextmanager
async def checked_body(
    source: AsyncIterator[bytes], check: RightsCheck
) -> AsyncIterator[Callable[[], Awaitable[bytes | None]]]:
    """A request body whose sender is checked (``check``) while its next bytes are
    awaited, not only when they come: a client that sends a byte and then nothing (its
    socket kept open) is asked about every ``RIGHTS_RECHECK_S`` meanwhile, and refused
    once its right is gone. Yields ``next_chunk``: the body's next chunk, None at its
    end; it raises the refusal or what ended the body (a client that went away)."""
    body = _Body()
    failure: Exception | None = None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(body.pump, source)
        try:
            yield lambda: body.next(check)
        except Exception as exc:  # raised as it is below, not in the task group's group
            failure = exc
        finally:
            tasks.cancel_scope.cancel()
    if failure is not None:
        raise failure


def parse_count(text: str, what: str, maximum: int = MAX_COUNT) -> int:
    """A non-negative whole number from a client (``what`` names it in the error): 1-19
    ASCII digits, at most ``maximum``; else InvalidInput, which each route turns into its
    own 4xx (400 for a page size, 416 for a range). The one parser of client numbers."""
    if not COUNT_RE.fullmatch(text):
        raise InvalidInput(
            f"{what} must be a whole number of ASCII digits (0-{maximum}), got {text[:40]!r}"
        )
    value = int(text)
    if value > maximum:
        raise InvalidInput(f"{what} must be at most {maximum}, got {shown(text)}")
    return value


def parse_bound(text: str, what: str, cap: int = MAX_COUNT) -> int:
    """A non-negative whole number from a client that only bounds something (a page size,
    a Range position): ASCII digits of any length, capped at ``cap`` (a value past it,
    however many digits, is ``cap``: never converted, so no digit count costs time);
    else InvalidInput. RFC 9110 14.1.1: a Range end past the blob means its end."""
    if not DIGITS_RE.fullmatch(text):
        raise InvalidInput(f"{what} must be a whole number of ASCII digits, got {text[:40]!r}")
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(cap)):
        return cap
    return min(int(digits), cap)


def declared_length(request: HubRequest) -> int | None:
    """The request's ``Content-Length``, None without one (chunked transfer); 400 when it
    is not a number ``parse_count`` takes."""
    text = request.headers.get("content-length")
    if text is None:
        return None
    try:
        return parse_count(text.strip(), "Content-Length")
    except InvalidInput as exc:
        raise RegistryError(Code.SIZE_INVALID, str(exc), status=400) from exc


def page_size(text: str | None, max_page: int) -> int:
    """The ``n`` of a paginated list (tags, catalog): absent means ``max_page``, larger
    values (of any length) are capped at it; not a number is 400."""
    if text is None:
        return max_page
    try:
        return parse_bound(text, "n", max_page)
    except InvalidInput as exc:
        raise RegistryError(Code.UNSUPPORTED, str(exc), status=400) from exc


def page_after(text: str | None, validate: Callable[[str], str], what: str) -> str | None:
    """The ``last`` of a paginated list (tags, catalog): absent, or a ``what`` (a tag, a
    repository name) as ``validate`` takes it, since a page continues after one of those
    the previous page's ``Link`` named; anything else (a megabyte of text compared with
    every row) is 400. Empty is absent (some clients send ``last=`` on the first page)."""
    if not text:
        return None
    try:
        return validate(text)
    except InvalidInput as exc:
        raise RegistryError(
            Code.UNSUPPORTED,
            f"last must be a {what}, as the previous page's Link header names it: {exc}",
            status=400,
        ) from exc


def parse_digest(text: str, code: Code = Code.DIGEST_INVALID) -> str:
    """A digest from a URL or query: sha256 or sha512 (``forkd.digest.parse``), else
    ``code`` (400 DIGEST_INVALID by default)."""
    try:
        return dg.validate_oci(text)
    except InvalidInput as exc:
        raise RegistryError(code, str(exc)) from exc


async def linked_blob_size(session: AsyncSession, repo_id: int, digest: str) -> int | None:
    """Size of a blob linked into the repository, or None."""
    row = await session.execute(
        select(Blob.size)
        .join(RepositoryBlob, RepositoryBlob.digest == Blob.digest)
        .where(RepositoryBlob.repository_id == repo_id, RepositoryBlob.digest == digest)
    )
    return row.scalar_one_or_none()


def in_chunks(digests: Iterable[str]) -> Iterator[list[str]]:
    """``digests`` in lists of at most ``IN_CHUNK``, for one ``IN (...)`` query each."""
    it = iter(digests)
    while chunk := list(islice(it, IN_CHUNK)):
        yield chunk


def linked_blob_sizes(session: Session, repo_id: int, digests: Iterable[str]) -> dict[str, int]:
    """The size of each of ``digests`` that is linked into the repository (one query per
    ``IN_CHUNK`` digests; sync ORM code)."""
    found: dict[str, int] = {}
    for chunk in in_chunks(set(digests)):
        rows = session.execute(
            select(Blob.digest, Blob.size)
            .join(RepositoryBlob, RepositoryBlob.digest == Blob.digest)
            .where(RepositoryBlob.repository_id == repo_id, RepositoryBlob.digest.in_(chunk))
        )
        found.update({digest: size for digest, size in rows})
    return found


def count_linked_blobs(session: Session, repo_id: int, digests: set[str]) -> int:
    """How many of ``digests`` are linked into the repository (a count per chunk)."""
    return sum(
        session.scalar(
            select(func.count())
            .select_from(RepositoryBlob)
            .where(RepositoryBlob.repository_id == repo_id, RepositoryBlob.digest.in_(chunk))
        )
        or 0
        for chunk in in_chunks(digests)
    )


@contextmanager
def database_contention() -> Iterator[None]:
    """Turn "database is locked" (SQLite gave up waiting ``SQLITE_BUSY_TIMEOUT_S`` for the
    write lock) into 503 with ``Retry-After``, which registry clients treat as temporary,
    instead of a 500. The wait itself happens in the hub: this is only its limit."""
    try:
        yield
    except sa_exc.OperationalError as exc:
        if not database_busy(exc):
            raise
        raise RegistryError(
            Code.TOOMANYREQUESTS,
            f"the database stayed locked by other writers for {SQLITE_BUSY_TIMEOUT_S} s; "
            f"nothing was changed, retry in {RETRY_AFTER_S} s",
            status=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from exc


def link_blob(session: Session, db: Database, repo_id: int, digest: str, size: int) -> None:
    """Record a stored blob and link it into a repository (idempotent, race-safe).

    Refused with DENIED when it would take the repository's namespace past its storage
    quota (hub/quotas.py). The link's time is refreshed on every push or mount, so GC's
    grace period counts from the last time anyone uploaded the blob, not the first.
    Sync ORM code: ``Database.write``, or ``run_sync`` in an async transaction.
    """
    db.write_lock(session)
    quotas.charge(session, repo_id, digest, size)
    session.execute(db.insert_ignore(Blob).values(digest=digest, size=size))
    session.execute(
        db.upsert_link(
            RepositoryBlob,
            {"repository_id": repo_id, "digest": digest, "created_at": utcnow()},
            ["repository_id", "digest"],
            "created_at",
        )
    )
