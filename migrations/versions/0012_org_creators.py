"""Who created an organisation (``namespaces.created_by``), and which namespace a
robot was made for (``users.robot_for``).

Any signed-in user creates organisations, at most ``MAX_ORGS_PER_USER`` (hub/orgs_api.py
``_below_org_limit``). The bound counted the organisations its creator was the direct
admin of at the time, so handing one over (another admin made, then left) gave the place
back and one account made namespaces without end; and anyone made the direct admin of an
organisation by someone else lost places of their own. Now the bound counts the
organisations the user created, by id (ids are never reused). Organisations created
before this revision count for nobody.

Likewise the bound on the robots a namespace's admins make in the UI's robot form
(``MAX_ROBOTS_PER_NAMESPACE``) counted its robot members: removing one from the
namespace gave the place back, and the robot (an account, a name no one else can take)
stayed. Now the robots made for the namespace count too, members or not.

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
    op.add_column("users", sa.Column("robot_for", sa.Integer(), nullable=True))
    op.create_index("ix_users_robot_for", "users", ["robot_for"])


def downgrade() -> None:
    op.drop_index("ix_users_robot_for", table_name="users")
    with op.batch_alter_table("users", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("robot_for")
    op.drop_index("ix_namespaces_created_by", table_name="namespaces")
    # SQLite recreates the table: keep its ids never reused (migration 0006).
    with op.batch_alter_table("namespaces", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("created_by")
