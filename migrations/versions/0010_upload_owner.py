"""Who started an upload session: ``uploads.user_id``.

The per-user limit on open upload sessions (``upload_sessions_per_user``,
hub/oci/uploads.py) counts a user's sessions across every namespace, so one member of an
organisation cannot take all of its ``upload_sessions_max`` places. Sessions from before
this revision have no owner (NULL): they count against their namespace only, and expire
as before.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.add_column(sa.Column("user_id", sa.Integer, nullable=True))
        batch.create_index("ix_uploads_user_id", ["user_id"])


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.drop_index("ix_uploads_user_id")
        batch.drop_column("user_id")
