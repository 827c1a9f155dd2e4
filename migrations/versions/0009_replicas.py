"""State that hub replicas share: upload sessions' progress and the token key.

Several ``forkd hub serve`` processes (each with its own data directory) share one
PostgreSQL and one S3 bucket (docs/hub.md, "Running several replicas"):

* ``uploads.size`` / ``uploads.touched_at``: how many bytes an upload session holds and
  when a request last added to it, so any replica continues a session another started
  (with the S3 blob backend its bytes are chunk objects in the bucket);
* ``upload_chunks``: one row per chunk of a session whose bytes are in the bucket,
  keyed by its offset (the key is what makes two writers of one offset exclusive);
* ``login_failures.attempt``: which credential an attempt in flight tries (a hash), so
  the limiter records an attempt before checking it, counting concurrent attempts of one
  credential once (hub/login_limit.py);
* ``hub_secrets``: the HMAC key of bearer tokens and UI sessions when none is
  configured, generated once per database instead of once per data directory.

Existing sessions keep their bytes in their hub's data directory; their size stays 0
here (the file-system backend reads sizes from the files).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.add_column(sa.Column("size", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("touched_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("login_failures") as batch:
        batch.add_column(sa.Column("attempt", sa.String(64), nullable=True))
    op.create_table(
        "upload_chunks",
        sa.Column(
            "upload_id",
            sa.String(32),
            sa.ForeignKey("uploads.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("start", sa.BigInteger, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
    )
    op.create_table(
        "hub_secrets",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("hub_secrets")
    op.drop_table("upload_chunks")
    with op.batch_alter_table("login_failures") as batch:
        batch.drop_column("attempt")
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("touched_at")
        batch.drop_column("size")
