"""Catalog UI: a repository's README (Markdown) and one-line description.

Revision ID: ui01
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ui01"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("repositories") as batch:
        batch.add_column(
            sa.Column("description", sa.String(300), nullable=False, server_default="")
        )
        batch.add_column(sa.Column("readme", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("repositories") as batch:
        batch.drop_column("readme")
        batch.drop_column("description")
