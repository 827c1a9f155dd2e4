"""Database engine, sessions and migrations (Alembic, applied through the app's engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, String, create_engine, event, make_url, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import QueryableAttribute, Session
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

import forkd.migrations
from forkd.errors import Conflict, InvalidInput

SQLITE_BUSY_TIMEOUT_S = 30
# How long a read on the event loop's thread may wait for a lock (WAL readers normally
# never wait; recovery after a crash or an outside backup can hold one) before it gives
# up and runs through aiosqlite's thread instead, where waiting blocks nothing else.
INLINE_BUSY_TIMEOUT_S = 0.05
GC_LOCK = 0x666F726B64  # "forkd": the advisory lock key between blob writers and GC
MIGRATE_LOCK = 0x6D69677261  # "migra": one migrating process at a time (PostgreSQL)
# Two-int advisory keys (class, repository id): one repository's manifest pushes and
# deletions, blob deletions and retention sweep, one at a time (PostgreSQL).
REPOSITORY_LOCK_CLASS = 0x7265706F  # "repo"
# The integers both backends store (BIGINT, SQLite INTEGER): a signed 64-bit number.
MIN_STORABLE, MAX_STORABLE = -(1 << 63), (1 << 63) - 1
# SQLSTATEs of a row another transaction wrote first: a unique key taken, a row referred
# to gone (PostgreSQL); SQLite's messages for the same.
RACED_SQLSTATES = ("23505", "23503")
RACED_SQLITE = ("UNIQUE constraint failed", "FOREIGN KEY constraint failed")
# SQLSTATEs of a transaction PostgreSQL ended so that another could go on: a deadlock it
# broke (two requests locking the same rows in opposite orders), a serialization failure,
# a lock it would not wait for. Nothing of the transaction was written; the same request
# sent again goes through.
TRANSIENT_SQLSTATES = ("40P01", "40001", "55P03")
T = TypeVar("T")
P = ParamSpec("P")


class ConcurrentChange(Conflict):
    """A write refused by the database because another request wrote first: a name it
    created was taken meanwhile (check-then-insert under READ COMMITTED), or a row it
    refers to was removed. The client's answer is 409, never a 500."""


def sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a database error (PostgreSQL's drivers; None from SQLite)."""
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return code if isinstance(code, str) else None


def transient(exc: DBAPIError) -> bool:
    """Whether the database ended ``exc``'s transaction only because of another one (a
    deadlock broken, a serialization failure, SQLite still locked after its busy wait):
    nothing was written and the request may be sent again."""
    code = sqlstate(exc)
    if code is not None:
        return code in TRANSIENT_SQLSTATES
    return isinstance(exc, OperationalError) and _busy(exc)


def raced(exc: IntegrityError) -> bool:
    """Whether ``exc`` is a unique key or a foreign key another transaction won."""
    code = sqlstate(exc)
    if code is not None:
        return code in RACED_SQLSTATES
    return str(exc.orig).startswith(RACED_SQLITE)


@contextmanager
def concurrent_changes_conflict() -> Iterator[None]:
    """Turn a unique or foreign key violation (a concurrent request won) into
    ``ConcurrentChange``; its text names no value (the statement's parameters stay out)."""
    try:
        yield
    except IntegrityError as exc:
        if not raced(exc):
            raise
        raise ConcurrentChange(
            "another request changed the same records at the same time (e.g. created one "
            "of this name, or removed one this request refers to); nothing was changed: "
            "look again, then repeat the request if it still applies"
        ) from exc


def like_literal(text: str) -> str:
    """``text`` for a SQL LIKE pattern with ``\\`` as escape: wildcards match literally."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# LIKE is one behaviour on both backends: case-sensitive, as PostgreSQL's is (SQLite's
# connections set ``case_sensitive_like``, below). A search that means to ignore case says
# so with ``contains_folded``, which folds A-Z only, on both: SQLite's lower() knows no
# other letters, and PostgreSQL's knows all of them (by its collation), so folding more on
# one backend would give two answers again.
_UPPER, _LOWER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"
_ASCII_FOLD = str.maketrans(_UPPER, _LOWER)


class ascii_lower(FunctionElement[str]):
    """SQL: ``text`` with A-Z made a-z and every other character as it is."""

    type = String()
    inherit_cache = True


@compiles(ascii_lower)
def _ascii_lower_sqlite(element: ascii_lower, compiler: Any, **kw: Any) -> str:
    return f"lower({compiler.process(element.clauses, **kw)})"  # ASCII only in SQLite


@compiles(ascii_lower, "postgresql")
def _ascii_lower_postgresql(element: ascii_lower, compiler: Any, **kw: Any) -> str:
    return f"translate({compiler.process(element.clauses, **kw)}, '{_UPPER}', '{_LOWER}')"


def contains_folded(
    column: ColumnElement[Any] | QueryableAttribute[Any], text: str
) -> ColumnElement[bool]:
    """``column`` holds ``text`` ignoring the case of A-Z (only), the same on SQLite and
    PostgreSQL."""
    pattern = f"%{like_literal(text.translate(_ASCII_FOLD))}%"
    return ascii_lower(column).like(pattern, escape="\\")


def migrations_dir() -> Path:
    return Path(forkd.migrations.__file__).parent


def alembic_config(connection: Connection | None = None, url: str = "") -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


class Database:
    """The async engine(s) and session factories: ``transaction`` for writes, ``reading``
    for read-only work (on SQLite a second engine whose transactions do not take the
    write lock, so readers run alongside each other and alongside one writer), and
    ``read`` for the small sync reads on every request's path (access checks, manifest
    resolution)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            Path(url.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
            args = {"timeout": SQLITE_BUSY_TIMEOUT_S}
            self.engine: AsyncEngine = create_async_engine(url, connect_args=args)
            _sqlite_setup(self.engine, begin="BEGIN IMMEDIATE")
            self.read_engine = create_async_engine(url, connect_args=args)
            _sqlite_setup(self.read_engine, begin="BEGIN")
            # pysqlite, used from the event loop's thread only (see ``read``).
            self.inline_engine: Engine | None = create_engine(
                make_url(url).set(drivername="sqlite"),
                connect_args={"timeout": INLINE_BUSY_TIMEOUT_S},
            )
            _sqlite_setup(self.inline_engine, begin="BEGIN", busy_s=INLINE_BUSY_TIMEOUT_S)
            # pysqlite for whole write transactions in worker threads (see ``write``).
            self.thread_engine: Engine | None = create_engine(
                make_url(url).set(drivername="sqlite"), connect_args=args
            )
            _sqlite_setup(self.thread_engine, begin="BEGIN IMMEDIATE")
        else:
            self.engine = create_async_engine(url, pool_pre_ping=True)
            self.read_engine = self.engine
            self.inline_engine = None
            self.thread_engine = None
        for engine in (self.engine, self.read_engine, self.inline_engine, self.thread_engine):
            if engine is not None:
                refuse_unstorable(engine)
        self._writer: anyio.CapacityLimiter | None = None  # made in the event loop
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.read_sessions = async_sessionmaker(self.read_engine, expire_on_commit=False)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """A session inside one transaction: committed on success, rolled back on error;
        a write another request's won is ``ConcurrentChange`` (409)."""
        with concurrent_changes_conflict():
            async with self.sessions() as session, session.begin():
                yield session

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[AsyncSession]:
        """A read-only transaction (one consistent snapshot); nothing it does is committed."""
        async with self.read_sessions() as session:
            try:
                yield session
            finally:
                session.expunge_all()  # loaded objects stay usable after the rollback
                await session.rollback()

    async def read(
        self, fn: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``fn(session, *args, **kwargs)`` (sync ORM code) in a read-only transaction.

        On SQLite it runs inline, on the calling thread, through a pysqlite session: an
        indexed read in WAL mode takes microseconds and never waits for writers, while a
        round trip to aiosqlite's thread costs ~0.3 ms, several times per session. This is
        what keeps a manifest GET, the registry's hottest request, cheap. Elsewhere (asyncpg)
        ``fn`` runs in an async session's greenlet. Loaded objects stay usable afterwards.
        """
        if self.inline_engine is not None:
            try:
                with Session(self.inline_engine, expire_on_commit=False) as session:
                    try:
                        return fn(session, *args, **kwargs)
                    finally:
                        session.expunge_all()
                        session.rollback()
            except OperationalError as exc:
                if not _busy(exc):
                    raise
        async with self.reading() as async_session:
            return await async_session.run_sync(fn, *args, **kwargs)

    async def write(
        self, fn: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``fn(session, *args, **kwargs)`` (sync ORM code) in one write transaction,
        committed when it returns, rolled back when it raises.

        On SQLite the whole transaction runs in a worker thread through a pysqlite session,
        one at a time per process, so the database's single write lock is held for the
        statements only. In an async session every statement is a round trip to
        aiosqlite's thread, each delayed while the event loop serves other requests, and
        writers waiting for the lock sleep in SQLite's busy handler: pushes of many small
        blobs queued for up to a second per transaction. Writers of one process now queue
        on a limiter of their own (not anyio's shared threads); other processes' writers
        still meet in the busy handler. Elsewhere (asyncpg) ``fn`` runs in an async
        session's greenlet.
        """
        if self.thread_engine is None:
            async with self.transaction() as async_session:
                return await async_session.run_sync(fn, *args, **kwargs)
        engine = self.thread_engine
        if self._writer is None:
            self._writer = anyio.CapacityLimiter(1)

        def run() -> T:
            with (
                concurrent_changes_conflict(),
                Session(engine, expire_on_commit=False) as session,
                session.begin(),
            ):
                return fn(session, *args, **kwargs)

        return await anyio.to_thread.run_sync(run, limiter=self._writer)

    async def migrate(self, revision: str = "head") -> None:
        """Bring the schema to ``revision`` with Alembic."""

        def upgrade(connection: Connection) -> None:
            command.upgrade(alembic_config(connection), revision)

        if not self.is_sqlite:
            async with self.engine.begin() as conn:
                # Replicas starting together migrate one after another: the later ones
                # find the schema at head and do nothing.
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
                await conn.run_sync(upgrade)
            return

        def upgrade_sqlite() -> None:
            # SQLite's way to change a table is to rebuild it (create, copy, drop, rename);
            # with foreign keys on, dropping the old table would cascade into its
            # dependants. So migrations run with them off, checked before the commit.
            engine = create_engine(make_url(self.url).set(drivername="sqlite"))
            _sqlite_setup(engine, begin="BEGIN IMMEDIATE", foreign_keys=False)
            try:
                with engine.begin() as conn:
                    upgrade(conn)
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                    if broken:
                        raise RuntimeError(
                            f"migration to {revision} left {len(broken)} dangling foreign "
                            f"keys (first: {tuple(broken[0])}); nothing was changed"
                        )
            finally:
                engine.dispose()

        await anyio.to_thread.run_sync(upgrade_sqlite)

    async def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        def current(connection: Connection) -> str | None:
            return MigrationContext.configure(connection).get_current_revision()

        async with self.engine.connect() as conn:
            return await conn.run_sync(current)

    def insert_ignore(self, table: Any) -> Insert:
        """``INSERT … ON CONFLICT DO NOTHING`` for this dialect (safe under concurrency)."""
        if self.is_sqlite:
            return sqlite.insert(table).on_conflict_do_nothing()
        return postgresql.insert(table).on_conflict_do_nothing()

    def upsert_link(
        self, table: Any, values: dict[str, Any], keys: list[str], touch: str
    ) -> Insert:
        """Insert, or on conflict set column ``touch`` to the new value (a "last linked" time)."""
        return self.upsert(table, values, keys, [touch])

    def upsert(
        self, table: Any, values: dict[str, Any], keys: list[str], changed: list[str]
    ) -> Insert:
        """Insert, or on conflict set the ``changed`` columns to their new values: one
        statement, so a row another transaction deletes meanwhile is inserted again (a
        read of the row, then an update of it, updated nothing: StaleDataError)."""
        set_ = {column: values[column] for column in changed}
        if self.is_sqlite:
            lite = sqlite.insert(table).values(**values)
            return lite.on_conflict_do_update(index_elements=keys, set_=set_)
        pg = postgresql.insert(table).values(**values)
        return pg.on_conflict_do_update(index_elements=keys, set_=set_)

    def write_lock(self, session: Session) -> None:
        """Writers that link or reference blobs take this; GC takes ``lock_for_gc``.

        SQLite already serialises write transactions (BEGIN IMMEDIATE); on PostgreSQL a
        shared transaction-scoped advisory lock lets writers run together but never
        alongside a GC sweep.
        """
        if not self.is_sqlite:
            session.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": GC_LOCK})

    async def lock_for_write(self, session: AsyncSession) -> None:
        """``write_lock`` from an async session."""
        await session.run_sync(self.write_lock)

    def repository_lock(self, session: Session, repository_id: int) -> None:
        """Writers that change what a repository's manifests reference take this, after
        ``write_lock``: a manifest push (its references checked and recorded), a manifest
        or blob deletion (checked against those references), the retention sweep and a
        server-side compaction. Each then sees the others' committed work: under READ
        COMMITTED a blob deletion and a manifest push referencing that blob could
        otherwise each check before the other commits, and both succeed. Held until the
        commit. SQLite serialises write transactions already (BEGIN IMMEDIATE).

        Lock order, everywhere: the GC lock's shared side, this, the namespace's quota
        lock (hub/quotas.py), then rows; so none of these writers waits for another in a
        cycle (uploads take no repository lock: they only add links)."""
        if not self.is_sqlite:
            session.execute(
                text("SELECT pg_advisory_xact_lock(:cls, :id)"),
                {"cls": REPOSITORY_LOCK_CLASS, "id": repository_id},
            )

    async def lock_repository(self, session: AsyncSession, repository_id: int) -> None:
        """``repository_lock`` from an async session."""
        await session.run_sync(self.repository_lock, repository_id)

    async def lock_for_gc(self, session: AsyncSession) -> None:
        if not self.is_sqlite:
            await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": GC_LOCK})

    async def close(self) -> None:
        await self.engine.dispose()
        if self.read_engine is not self.engine:
            await self.read_engine.dispose()
        if self.inline_engine is not None:
            self.inline_engine.dispose()
        if self.thread_engine is not None:
            self.thread_engine.dispose()


class UnstorableValue(InvalidInput):
    """A value from a client that no backend stores as sent: text with a NUL character
    (PostgreSQL refuses it) or a lone surrogate (not UTF-8), or an integer past 64 bits."""


def check_storable(value: object) -> None:
    """Raise ``UnstorableValue`` unless every text and integer in ``value`` (a statement's
    parameters: a tuple, list or dict of them, nested for executemany) can be stored."""
    if isinstance(value, str):
        if "\x00" in value:
            raise UnstorableValue(
                f"text {value[:40]!r} contains a NUL character, which the hub cannot store; "
                "remove it"
            )
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise UnstorableValue(
                f"text {value[:40]!r} is not valid Unicode (a lone surrogate); send UTF-8"
            ) from exc
    elif isinstance(value, int) and not isinstance(value, bool):
        if not MIN_STORABLE <= value <= MAX_STORABLE:
            raise UnstorableValue(
                f"number {str(value)[:40]} is out of range: use at most {MAX_STORABLE}"
            )
    elif isinstance(value, dict):
        for item in value.values():
            check_storable(item)
    elif isinstance(value, list | tuple):
        for item in value:
            check_storable(item)


def refuse_unstorable(engine: AsyncEngine | Engine) -> None:
    """Check every statement's parameters before they reach the database (the one place
    every query goes through), so a NUL in a name, tag or query text from any route is a
    400 on both backends, not a 500 from PostgreSQL."""
    sync_engine = engine.sync_engine if isinstance(engine, AsyncEngine) else engine

    @event.listens_for(sync_engine, "before_cursor_execute")
    def check(
        _conn: Connection,
        _cursor: Any,
        _statement: str,
        parameters: Any,
        _context: Any,
        _executemany: bool,
    ) -> None:
        check_storable(parameters)


def _busy(exc: OperationalError) -> bool:
    """Whether SQLite gave up waiting for a lock ("database is locked" / "is busy")."""
    text_ = str(exc.orig).lower()
    return "locked" in text_ or "busy" in text_


def _sqlite_setup(
    engine: AsyncEngine | Engine,
    begin: str,
    busy_s: float = SQLITE_BUSY_TIMEOUT_S,
    *,
    foreign_keys: bool = True,
) -> None:
    """WAL, foreign keys, and explicit transactions: ``BEGIN IMMEDIATE`` for writers so
    concurrent writers wait instead of failing; plain ``BEGIN`` for readers."""

    sync_engine = engine.sync_engine if isinstance(engine, AsyncEngine) else engine

    @event.listens_for(sync_engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: never corrupt; a power cut may undo the last commits (blob files are
        # fsynced by the store, so at worst a push must be repeated).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_s * 1000)}")
        # LIKE as PostgreSQL's: case-sensitive (SQLite's ignores the case of A-Z), so a
        # pattern matches the same rows on both (a name filter ``ACME`` matched ``acme``'s
        # rows on SQLite only). Searches that ignore case say so: ``contains_folded``.
        cursor.execute("PRAGMA case_sensitive_like=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(begin)


def run_migrations(url: str, revision: str = "head") -> None:
    """Synchronous entry point for the CLI."""

    async def go() -> None:
        db = Database(url)
        try:
            await db.migrate(revision)
        finally:
            await db.close()

    asyncio.run(go())
