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
"""

from __future__ import annotations

import os
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from forkd.errors import InvalidInput
from forkd.hub.db import Database
from forkd.hub.models import HubSecret
from forkd.hub.settings import HubSettings

TOKEN_KEY = "token"
BLOB_DIRECTORY_KEY = "fs-blob-directory"


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


async def claim_blob_directory(db: Database, settings: HubSettings) -> None:
    """With the filesystem blob backend: record this data directory as the one holding
    the database's blobs (first start), or refuse to start if another one is."""
    if settings.blob_backend != "fs":
        return
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
