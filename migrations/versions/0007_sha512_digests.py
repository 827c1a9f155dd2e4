"""Digest columns wide enough for sha512 (``sha512:`` + 128 hex = 135 characters).

OCI allows sha512 digests for blobs and manifest references; every column holding a
digest grows from 71 to 135 characters. PostgreSQL changes the types in place (a
longer varchar is compatible with the foreign keys between them); SQLite does not
enforce lengths, and batch mode rebuilds the tables so the declared types match.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SHA256_LEN = 71
SHA512_LEN = 135
# (table, column, nullable); the referenced blobs.digest first.
DIGEST_COLUMNS = (
    ("blobs", "digest", False),
    ("repository_blobs", "digest", False),
    ("manifests", "digest", False),
    ("manifests", "subject_digest", True),
    ("manifest_references", "digest", False),
    ("tags", "manifest_digest", False),
)


def _resize(old: int, new: int) -> None:
    for table, column, nullable in DIGEST_COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(
                column,
                existing_type=sa.String(old),
                type_=sa.String(new),
                existing_nullable=nullable,
            )


def upgrade() -> None:
    _resize(SHA256_LEN, SHA512_LEN)


def downgrade() -> None:
    # Refused by PostgreSQL while a sha512 digest is stored (it would not fit).
    _resize(SHA512_LEN, SHA256_LEN)
