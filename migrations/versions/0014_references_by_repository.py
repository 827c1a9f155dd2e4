"""Reads of one repository's references and referrers by that repository's own rows.

"Which manifests of repository R reference D" (a blob's or a child manifest's deletion)
was answered through ``ix_manifest_references_digest``: every reference to D on the hub,
filtered by repository afterwards. "Which manifests of R have subject D" (referrers, a
chain's descendants on the pack and lineage pages, a snapshot's dependents) likewise
through ``ix_manifests_subject_digest``. A ``subject`` may name any digest, and common
digests (the empty config ``{}``) are referenced by every namespace, so another account
pushing many manifests that name a digest of yours made each of those reads of yours
scan all of them. ``manifest_references.repository_id`` (the manifest's, filled from
``manifests``) with ``ix_manifest_references_repository (repository_id, digest)``, and
``ix_manifests_repository_subject (repository_id, subject_digest, digest)`` in place of
the index on ``subject_digest`` alone, keep each read within the repository's rows.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("manifest_references", sa.Column("repository_id", sa.Integer(), nullable=True))
    op.execute(
        "UPDATE manifest_references SET repository_id = (SELECT manifests.repository_id "
        "FROM manifests WHERE manifests.id = manifest_references.manifest_id)"
    )
    op.execute("DELETE FROM manifest_references WHERE repository_id IS NULL")  # no manifest
    with op.batch_alter_table("manifest_references") as batch:
        batch.alter_column("repository_id", existing_type=sa.Integer(), nullable=False)
    op.create_index(
        "ix_manifest_references_repository", "manifest_references", ["repository_id", "digest"]
    )
    op.create_index(
        "ix_manifests_repository_subject",
        "manifests",
        ["repository_id", "subject_digest", "digest"],
    )
    op.drop_index("ix_manifests_subject_digest", table_name="manifests")


def downgrade() -> None:
    op.create_index("ix_manifests_subject_digest", "manifests", ["subject_digest"])
    op.drop_index("ix_manifests_repository_subject", table_name="manifests")
    op.drop_index("ix_manifest_references_repository", table_name="manifest_references")
    with op.batch_alter_table("manifest_references") as batch:
        batch.drop_column("repository_id")
