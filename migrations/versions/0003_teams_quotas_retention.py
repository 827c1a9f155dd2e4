"""Teams (and their members), per-namespace storage quotas, each tag's last pull time.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "namespace_id",
            sa.Integer,
            sa.ForeignKey("namespaces.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("role", sa.String(8), nullable=False),
        sa.Column("repositories", sa.String(255), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("namespace_id", "name"),
    )
    op.create_table(
        "team_members",
        sa.Column(
            "team_id",
            sa.Integer,
            sa.ForeignKey("teams.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "user_id",
            sa.Integer,
            sa.ForeignKey("users.id", ondelete="CASCADE"),
            primary_key=True,
        ),
    )
    op.create_index("ix_team_members_user_id", "team_members", ["user_id"])
    with op.batch_alter_table("namespaces") as batch:
        batch.add_column(sa.Column("quota_bytes", sa.BigInteger, nullable=True))
    with op.batch_alter_table("tags") as batch:
        batch.add_column(sa.Column("last_pulled_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tags") as batch:
        batch.drop_column("last_pulled_at")
    with op.batch_alter_table("namespaces") as batch:
        batch.drop_column("quota_bytes")
    op.drop_index("ix_team_members_user_id", table_name="team_members")
    op.drop_table("team_members")
    op.drop_table("teams")
