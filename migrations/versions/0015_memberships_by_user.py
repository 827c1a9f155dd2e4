"""An index of memberships by user.

"A user's memberships" is asked on every listing a signed-in user reads (``authz.Grants``
for every namespace), for the robots a user manages (the tokens page) and when a user is
removed; the primary key ``(namespace_id, user_id)`` serves only reads by namespace, so
each of those read every membership of the hub, and any signed-in user adds members to
the organisations it creates.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_memberships_user_id", "memberships", ["user_id"])


def downgrade() -> None:
    op.drop_index("ix_memberships_user_id", table_name="memberships")
