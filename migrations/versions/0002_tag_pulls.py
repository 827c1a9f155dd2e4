"""Pull counts per tag (the catalog's tags table), next to the per-repository count.

Revision ID: 0002
Revises: ui01
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "ui01"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tags") as batch:
        batch.add_column(sa.Column("pull_count", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tags") as batch:
        batch.drop_column("pull_count")
