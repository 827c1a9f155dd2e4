"""Alembic environment: runs on the connection the hub passes in, or on sqlalchemy.url."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from forkd.hub.models import Base

config = context.config
target_metadata = Base.metadata


def run_on(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_with_url(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(run_on)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; use `forkd hub migrate`")

given = config.attributes.get("connection")
if given is not None:
    run_on(given)
else:
    asyncio.run(run_with_url(config.get_main_option("sqlalchemy.url") or ""))
