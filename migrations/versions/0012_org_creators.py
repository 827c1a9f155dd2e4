"""Who created an organisation: ``namespaces.created_by``.

Any signed-in user creates organisations, at most ``MAX_ORGS_PER_USER`` (hub/orgs_api.py
``_below_org_limit``). The bound counted the organisations its creator was the direct
admin of at the time, so handing one over (another admin made, then left) gave the place
back and one account made namespaces without end; and anyone made the direct admin of an
organisation by someone else lost places of their own. Now the bound counts the
organisations the user created, by id (ids are never reused). Organisations created
before this revision count for nobody.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("namespaces", sa.Column("created_by", sa.Integer(), nullable=True))
    op.create_index("ix_namespaces_created_by", "namespaces", ["created_by"])


def downgrade() -> None:
    op.drop_index("ix_namespaces_created_by", table_name="namespaces")
    # SQLite recreates the table: keep its ids never reused (migration 0006).
    with op.batch_alter_table("namespaces", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("created_by")
