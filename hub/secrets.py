"""What the hub generates once and keeps in the database (``hub_secrets``): the HMAC key
(bearer tokens, UI sessions), shared by every replica, and which data directory holds
the blobs of a filesystem-backend hub.

A key set in the settings (``secret``, FORKD_HUB_SECRET) is used as it is. Without one
the key lives in the database (``hub_secrets``), so every ``forkd hub serve`` on that
database signs and checks with the same key whatever its data directory: a token one
replica issued is good on the others. The first process to start creates it (an insert
that loses to a concurrent one reads the winner's); a hub that kept its key in
``DATA/token-secret`` before (one replica) carries that key into the database, so
tokens and sessions already handed out stay valid.

With the filesystem blob backend the blobs are files in one data directory, so only the
processes serving from that directory may use the database (``--workers`` do). The
first start records the directory's id (``DATA/blobs-id``, made once) in the database;
a process on the same database with another data directory (a second replica, or a
SQLite file shared between directories) is refused at start, saying what to do, instead
of answering with blobs it does not have and sweeping the others' as unreferenced.

With the S3 blob backend the bucket (under ``s3_prefix``) is the shared thing: the
database gets an id (``hub_secrets``, made once) and the first start writes it into the
bucket (``PREFIX/owner``, ``S3BlobStore.claim``); a process whose database has another
id (replicas each with their own SQLite file on one bucket, whose GC would sweep one
another's blobs) is refused at start.
"""

from __future__ import annotations

import os
import secrets

import anyio
from sqlalchemy import select
from sqlalchemy.orm import Session

from forkd.errors import InvalidInput
from forkd.hub.db import Database
from forkd.hub.models import HubSecret
from forkd.hub.settings import HubSettings
from forkd.store.blobs import BlobStore
from forkd.store.s3 import S3BlobStore

TOKEN_KEY = "token"
BLOB_DIRECTORY_KEY = "fs-blob-directory"
DATABASE_ID_KEY = "database-id"


async def load_token_key(db: Database, settings: HubSettings) -> bytes:
    """The key to sign with: configured, else the database's (created on first use)."""
    if settings.secret:
        return settings.secret.encode()
    stored = await db.read(_stored, TOKEN_KEY)
    if stored is None:
        candidate = _legacy_key(settings) or secrets.token_hex(32)
        stored = await db.write(_store_once, db, TOKEN_KEY, candidate)
    return stored.encode()


def _stored(session: Session, name: str) -> str | None:
    return session.scalar(select(HubSecret.value).where(HubSecret.name == name))


def _store_once(session: Session, db: Database, name: str, value: str) -> str:
    """Insert ``value`` unless a key is there already; return the key that is."""
    session.execute(db.insert_ignore(HubSecret).values(name=name, value=value))
    stored = _stored(session, name)
    assert stored is not None
    return stored


def _legacy_key(settings: HubSettings) -> str | None:
    """The key an earlier hub generated in its data directory, if it has one."""
    try:
        text = settings.secret_file.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text if 0 < len(text) <= 128 else None


async def claim_blob_storage(db: Database, settings: HubSettings, blobs: BlobStore) -> None:
    """Refuse to start unless this database is the one that catalogs these blobs: with
    the filesystem backend, this data directory is the one the database recorded (first
    start: recorded now); with S3, the bucket's prefix names this database (first start:
    named now)."""
    if isinstance(blobs, S3BlobStore):
        await _claim_bucket(db, settings, blobs)
    elif settings.blob_backend == "fs":
        await _claim_directory(db, settings)


async def _claim_directory(db: Database, settings: HubSettings) -> None:
    mine = _directory_id(settings)
    claimed = await db.write(_store_once, db, BLOB_DIRECTORY_KEY, mine)
    if claimed != mine:
        raise InvalidInput(
            f"this database's blobs are in another data directory (filesystem blob backend, "
            f"directory id {claimed}), not in {settings.data_dir} (id {mine}): several hub "
            "processes on one database (replicas behind a load balancer) need PostgreSQL "
            'and blob_backend = "s3" on every one (docs/hub.md, "Running several '
            'replicas"); to move one hub to a new data directory, move its blobs-id file '
            "with its blobs/ folder"
        )


async def _claim_bucket(db: Database, settings: HubSettings, blobs: S3BlobStore) -> None:
    mine = await db.write(_store_once, db, DATABASE_ID_KEY, secrets.token_hex(16))
    owner = await anyio.to_thread.run_sync(blobs.claim, mine)
    if owner != mine:
        where = f"s3://{settings.s3_bucket}/{blobs.prefix}"
        raise InvalidInput(
            f"the blobs in {where} are cataloged by another database (id {owner[:40]!r}), "
            f"not this one (id {mine}): replicas on one bucket must share one PostgreSQL "
            "database (database_url), not each have their own (a SQLite file per replica "
            "would let one's GC delete the others' blobs; docs/hub.md, \"Running several "
            f'replicas"); or give this hub its own bucket or s3_prefix. A restored or '
            f"moved database keeps its id in hub_secrets (name {DATABASE_ID_KEY!r})"
        )


def _directory_id(settings: HubSettings) -> str:
    """The data directory's id (``DATA/blobs-id``), made on first use."""
    path = settings.blob_directory_id_file
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        if len(text) != 32 or not all(c in "0123456789abcdef" for c in text):
            raise InvalidInput(
                f"{path} does not hold a data directory id (32 hex digits): restore it "
                "from a backup, or remove it only if this directory's blobs/ is the "
                "database's"
            ) from None
        return text
    value = secrets.token_hex(16)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
        f.flush()
        os.fsync(f.fileno())
    return value
