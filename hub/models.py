"""The hub's database tables (SQLAlchemy 2). Alembic migrations in migrations/ create them.

Blob bytes live in the shared blob store, once per digest; ``blobs`` records what
the store holds and ``repository_blobs`` links a blob into a repository (the
per-repository linked store). Manifest bytes are blobs too; ``manifests`` keeps
what the routes need without reading them (media type, artifact type, subject).
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DIGEST_LEN = 135  # "sha512:" + 128 hex (sha256: 71); migration 0007
ROLES = ("pull", "push", "admin")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_stamp() -> str:
    """A principal's security stamp: 128 random bits, new for every user and at every
    password change, so a session or bearer minted before stops matching."""
    return secrets.token_hex(16)


# Integer ids are never handed out twice (SQLite AUTOINCREMENT; PostgreSQL sequences
# never go back), so a deleted user's, token's or repository's id never names another.
NO_REUSE = {"sqlite_autoincrement": True}


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    __table_args__ = NO_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(255), nullable=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    is_robot: Mapped[bool] = mapped_column(Boolean, default=False)
    # Carried (hashed) by every session, bearer token and cached credential of this user;
    # a new one at every password change (accounts.set_password).
    stamp: Mapped[str] = mapped_column(String(32), default=new_stamp)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The namespace (by id) whose admins made this robot in the UI's robot form: what
    # the bound on the robots a namespace makes counts, members or not (migration 0012).
    robot_for: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class Namespace(Base):
    """A user's own namespace (kind ``user``) or an organisation's (kind ``org``)."""

    __tablename__ = "namespaces"
    __table_args__ = NO_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    kind: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Storage quota in bytes (blobs linked into its repositories, each once); None: none.
    quota_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The running total of that usage while there is a quota (hub/quotas.py); else None.
    used_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The user who created an organisation (by id, never reused): what the bound on the
    # organisations one user creates counts (migration 0012); None for a user's own
    # namespace, one a site admin's push made, or one created before the migration.
    created_by: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class Membership(Base):
    """A user's role (pull / push / admin) in a namespace."""

    __tablename__ = "memberships"

    namespace_id: Mapped[int] = mapped_column(
        ForeignKey("namespaces.id", ondelete="CASCADE"), primary_key=True
    )
    # Indexed: "a user's memberships" (every listing's grants, the robots one manages, a
    # user's removal) is asked by user; the primary key serves only by namespace (0015).
    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    role: Mapped[str] = mapped_column(String(8))


class Team(Base):
    """A group of an organisation's members holding one role on its repositories (all of
    them, or those whose full name matches ``repositories``: accounts.TEAM_GLOB_RE)."""

    __tablename__ = "teams"
    __table_args__ = (UniqueConstraint("namespace_id", "name"), NO_REUSE)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace_id: Mapped[int] = mapped_column(ForeignKey("namespaces.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(8))
    repositories: Mapped[str] = mapped_column(String(255), default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TeamMember(Base):
    __tablename__ = "team_members"

    team_id: Mapped[int] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class ApiToken(Base):
    """A long-lived secret for a user or robot; only its sha256 is stored."""

    __tablename__ = "api_tokens"
    __table_args__ = NO_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(Text)  # space-separated NAMESPACE:ROLE, '*' = any
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The user who minted a robot's token for it (None: the operator, or the account's
    # own): the token stands only while they may still manage the robot (migration 0013).
    minted_by: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class Repository(Base):
    __tablename__ = "repositories"
    __table_args__ = NO_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    namespace_id: Mapped[int] = mapped_column(
        ForeignKey("namespaces.id", ondelete="CASCADE"), index=True
    )
    is_public: Mapped[bool] = mapped_column(Boolean, default=False)
    pull_count: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    description: Mapped[str] = mapped_column(String(300), default="", server_default="")
    readme: Mapped[str] = mapped_column(Text, default="", server_default="")


class Blob(Base):
    """A blob present in the blob store (global, once per digest)."""

    __tablename__ = "blobs"

    digest: Mapped[str] = mapped_column(String(DIGEST_LEN), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RepositoryBlob(Base):
    """A blob linked into a repository: what ``/v2/NAME/blobs/DIGEST`` may serve."""

    __tablename__ = "repository_blobs"

    repository_id: Mapped[int] = mapped_column(
        ForeignKey("repositories.id", ondelete="CASCADE"), primary_key=True
    )
    # Indexed: "which repositories link this blob" (quotas, GC) is asked by digest.
    digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"), primary_key=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Manifest(Base):
    __tablename__ = "manifests"
    # "The repository's manifests whose subject is D" (referrers, a chain's descendants,
    # a snapshot's dependents) by one index of the repository's own rows (migration
    # 0014): an index on ``subject_digest`` alone held every repository's manifests
    # naming D, and a ``subject`` may name any digest, so another namespace pushing many
    # manifests naming yours made each of those reads of yours scan all of them.
    __table_args__ = (
        UniqueConstraint("repository_id", "digest"),
        Index("ix_manifests_repository_subject", "repository_id", "subject_digest", "digest"),
        NO_REUSE,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    repository_id: Mapped[int] = mapped_column(ForeignKey("repositories.id", ondelete="CASCADE"))
    digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"))
    media_type: Mapped[str] = mapped_column(String(255))
    artifact_type: Mapped[str | None] = mapped_column(String(255), nullable=True)
    subject_digest: Mapped[str | None] = mapped_column(String(DIGEST_LEN), nullable=True)
    annotations: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON object
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ManifestReference(Base):
    """A digest a manifest keeps alive: its config, layers, child manifests and subject."""

    __tablename__ = "manifest_references"
    # "Which manifests of this repository reference D" (a blob's or a child manifest's
    # deletion) by the repository's own rows (migration 0014), never by every reference
    # to D on the hub: a digest such as the empty config ``{}`` is referenced by any
    # number of other namespaces' manifests.
    __table_args__ = (Index("ix_manifest_references_repository", "repository_id", "digest"),)

    manifest_id: Mapped[int] = mapped_column(
        ForeignKey("manifests.id", ondelete="CASCADE"), primary_key=True
    )
    digest: Mapped[str] = mapped_column(String(DIGEST_LEN), primary_key=True, index=True)
    repository_id: Mapped[int] = mapped_column(Integer)  # the manifest's


class Tag(Base):
    __tablename__ = "tags"
    # "The tags on this manifest" (a lineage's names, a manifest's delete) read by index:
    # any number of tags may name one manifest (migration 0011).
    __table_args__ = (Index("ix_tags_manifest", "repository_id", "manifest_digest", "name"),)

    repository_id: Mapped[int] = mapped_column(
        ForeignKey("repositories.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    manifest_digest: Mapped[str] = mapped_column(String(DIGEST_LEN))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    pull_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    last_pulled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Upload(Base):
    """An upload session (or a monolithic upload while its request runs); its bytes so
    far are a file in the uploads area. ``reserved_bytes``: the size the request writing
    it may take the file to, reserved against the namespace's quota under the write lock
    (0 while no request writes it; hub/oci/uploads.py)."""

    __tablename__ = "uploads"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    repository_id: Mapped[int] = mapped_column(ForeignKey("repositories.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    reserved_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Shared upload sessions (S3 blob backend; hub/shared_uploads.py): the bytes its
    # chunks hold and when a request last added one (NULL: since ``created_at``). The
    # file-system backend keeps both in the session's file (hub/storage.py).
    size: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    touched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Who started it (NULL: anonymous, or a session from before migration 0010): the
    # per-user session limit ``upload_sessions_per_user`` counts by it.
    user_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class UploadChunk(Base):
    """One chunk of a shared upload session: ``size`` bytes from ``start``, an object in
    the bucket under the session's key prefix (hub/shared_uploads.py). The primary key
    makes two requests writing at one offset exclusive: one insert wins."""

    __tablename__ = "upload_chunks"

    upload_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True
    )
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(String(64))  # the object's name under the session's prefix


class HubSecret(Base):
    """A key the hub generated because none was configured (``token``: bearer tokens and
    UI sessions), shared by every replica on this database (hub/secrets.py)."""

    __tablename__ = "hub_secrets"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))


class LoginFailure(Base):
    """One failed login, or one being checked, counted per key (``ip:ADDRESS``) by the
    limiter (hub/login_limit.py). In the database, so every worker process and replica
    shares the count."""

    __tablename__ = "login_failures"
    __table_args__ = NO_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(80), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    # While the attempt is checked, a hash of the credential tried (attempts in flight
    # count once per credential); NULL once it failed (each failure counts).
    attempt: Mapped[str | None] = mapped_column(String(64), nullable=True)


class UiSession(Base):
    """A signed-in browser session, so sign-out (and removal of its user or token) ends it
    on the server: the cookie names the session by a random id, stored here hashed."""

    __tablename__ = "ui_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=True, index=True
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
