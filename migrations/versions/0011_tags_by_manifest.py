"""An index of tags by the manifest they name: ``ix_tags_manifest``.

The pack page, a tag page and the lineage API read the tag names of the manifests they
show (hub/chains.py ``tag_names``, at most ``TAG_NAMES_MAX`` each) and a manifest's
delete removes its tags: by ``(repository_id, manifest_digest)``, which the primary key
``(repository_id, name)`` does not order. Without the index each such read scanned every
tag of the repository.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_tags_manifest", "tags", ["repository_id", "manifest_digest", "name"])


def downgrade() -> None:
    op.drop_index("ix_tags_manifest", table_name="tags")
