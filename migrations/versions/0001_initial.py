"""Initial hub schema: accounts, repositories, blobs, manifests, tags, uploads.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
DIGEST = sa.String(71)


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("password_hash", sa.String(255), nullable=True),
        sa.Column("is_admin", sa.Boolean, nullable=False),
        sa.Column("is_robot", sa.Boolean, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "namespaces",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "memberships",
        sa.Column(
            "namespace_id",
            sa.Integer,
            sa.ForeignKey("namespaces.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "user_id", sa.Integer, sa.ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("role", sa.String(8), nullable=False),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "user_id", sa.Integer, sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=True),
    )
    op.create_table(
        "repositories",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column(
            "namespace_id",
            sa.Integer,
            sa.ForeignKey("namespaces.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("is_public", sa.Boolean, nullable=False),
        sa.Column("pull_count", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "blobs",
        sa.Column("digest", DIGEST, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "repository_blobs",
        sa.Column(
            "repository_id",
            sa.Integer,
            sa.ForeignKey("repositories.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("digest", DIGEST, sa.ForeignKey("blobs.digest"), primary_key=True),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "manifests",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "repository_id",
            sa.Integer,
            sa.ForeignKey("repositories.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("digest", DIGEST, sa.ForeignKey("blobs.digest"), nullable=False),
        sa.Column("media_type", sa.String(255), nullable=False),
        sa.Column("artifact_type", sa.String(255), nullable=True),
        sa.Column("subject_digest", DIGEST, nullable=True),
        sa.Column("annotations", sa.Text, nullable=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("repository_id", "digest"),
    )
    op.create_index("ix_manifests_subject_digest", "manifests", ["subject_digest"])
    op.create_table(
        "manifest_references",
        sa.Column(
            "manifest_id",
            sa.Integer,
            sa.ForeignKey("manifests.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("digest", DIGEST, primary_key=True),
    )
    op.create_index("ix_manifest_references_digest", "manifest_references", ["digest"])
    op.create_table(
        "tags",
        sa.Column(
            "repository_id",
            sa.Integer,
            sa.ForeignKey("repositories.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("manifest_digest", DIGEST, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column(
            "repository_id",
            sa.Integer,
            sa.ForeignKey("repositories.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in (
        "uploads",
        "tags",
        "manifest_references",
        "manifests",
        "repository_blobs",
        "blobs",
        "repositories",
        "api_tokens",
        "memberships",
        "namespaces",
        "users",
    ):
        op.drop_table(table)
