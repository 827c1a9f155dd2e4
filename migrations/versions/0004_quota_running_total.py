"""A namespace's running total of used bytes while it has a storage quota, and the indexes
that make the quota and GC questions ("which repositories link this blob", "which
repositories are in this namespace") lookups instead of scans.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("namespaces") as batch:
        batch.add_column(sa.Column("used_bytes", sa.BigInteger, nullable=True))
    op.create_index("ix_repository_blobs_digest", "repository_blobs", ["digest"])
    op.create_index("ix_repositories_namespace_id", "repositories", ["namespace_id"])
    # Namespaces that already have a quota start their total from what they hold now.
    op.execute(
        """
        UPDATE namespaces SET used_bytes = (
            SELECT COALESCE(SUM(blobs.size), 0) FROM blobs WHERE blobs.digest IN (
                SELECT repository_blobs.digest FROM repository_blobs
                JOIN repositories ON repositories.id = repository_blobs.repository_id
                WHERE repositories.namespace_id = namespaces.id
            )
        )
        WHERE quota_bytes IS NOT NULL
        """
    )


def downgrade() -> None:
    op.drop_index("ix_repositories_namespace_id", "repositories")
    op.drop_index("ix_repository_blobs_digest", "repository_blobs")
    with op.batch_alter_table("namespaces") as batch:
        batch.drop_column("used_bytes")
