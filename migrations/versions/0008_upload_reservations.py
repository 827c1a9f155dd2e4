"""Quota reservations of uploads in flight: ``uploads.reserved_bytes``.

A request that writes an upload (``PATCH``, ``PUT`` with a body, monolithic ``POST``)
reserves the room it may fill under the write lock before it streams, so concurrent
uploads of one namespace cannot together take it past its quota. Existing sessions
start with no reservation (no request is writing them during a migration).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.add_column(
            sa.Column("reserved_bytes", sa.BigInteger, nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("reserved_bytes")
