"""Principals that stay gone: ids never reused, a security stamp per user, server-side
UI sessions.

- SQLite reuses the highest deleted ``INTEGER PRIMARY KEY``; the tables whose ids name
  principals or their property are rebuilt with AUTOINCREMENT. (PostgreSQL's sequences
  never hand out an id twice already.) Ids deleted before this migration may still be
  reused once; the stamps below make that harmless.
- ``users.stamp``: random, new at every password change; sessions, bearer tokens and
  cached credentials carry a hash of it (with their API token's hash), so none of them
  survives the removal of its user or token, even if an id comes back.
- ``ui_sessions``: the browser sessions, so that sign-out ends one on the server.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEVER_REUSED = (
    "users",
    "namespaces",
    "teams",
    "api_tokens",
    "repositories",
    "manifests",
    "login_failures",
)


def upgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("stamp", sa.String(32), nullable=True))
    conn = op.get_bind()
    users = sa.table("users", sa.column("id", sa.Integer), sa.column("stamp", sa.String))
    for (user_id,) in conn.execute(sa.select(users.c.id)).all():
        conn.execute(
            users.update().where(users.c.id == user_id).values(stamp=secrets.token_hex(16))
        )
    with op.batch_alter_table("users") as batch:
        batch.alter_column("stamp", existing_type=sa.String(32), nullable=False)
    if conn.dialect.name == "sqlite":
        # Rebuilt with AUTOINCREMENT; the hub migrates SQLite with foreign keys off
        # (hub/db.py), so dropping the old table cascades nothing.
        for name in NEVER_REUSED:
            with op.batch_alter_table(
                name, recreate="always", table_kwargs={"sqlite_autoincrement": True}
            ):
                pass
    op.create_table(
        "ui_sessions",
        sa.Column("id_hash", sa.String(64), primary_key=True),
        sa.Column(
            "user_id", sa.Integer, sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column(
            "token_id",
            sa.Integer,
            sa.ForeignKey("api_tokens.id", ondelete="CASCADE"),
            nullable=True,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ui_sessions_user_id", "ui_sessions", ["user_id"])
    op.create_index("ix_ui_sessions_token_id", "ui_sessions", ["token_id"])
    op.create_index("ix_ui_sessions_expires_at", "ui_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_ui_sessions_expires_at", table_name="ui_sessions")
    op.drop_index("ix_ui_sessions_token_id", table_name="ui_sessions")
    op.drop_index("ix_ui_sessions_user_id", table_name="ui_sessions")
    op.drop_table("ui_sessions")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("stamp")
    # AUTOINCREMENT stays on SQLite: ids that are never reused break nothing older.
