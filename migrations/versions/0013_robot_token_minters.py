"""Who minted a robot's API token (``api_tokens.minted_by``).

An organisation admin mints tokens for the organisation's robots (the UI's robot form).
The token outlived the admin: removed from the organisation, or their account deleted,
they still held a secret that acted as the robot, with the robot's rights in the
organisation. Now a robot's token minted by someone else holds only while its minter
still exists and may still manage the robot (``authz.minter_stands``). Tokens minted
before this revision, by the operator (``forkd hub token create``) or by the robot's
own account carry no minter and stand as before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("minted_by", sa.Integer(), nullable=True))
    op.create_index("ix_api_tokens_minted_by", "api_tokens", ["minted_by"])


def downgrade() -> None:
    op.drop_index("ix_api_tokens_minted_by", table_name="api_tokens")
    # SQLite recreates the table: keep its ids never reused (migration 0006).
    with op.batch_alter_table("api_tokens", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("minted_by")
