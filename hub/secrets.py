"""The hub's HMAC key (bearer tokens, UI sessions), shared by every replica.

A key set in the settings (``secret``, FORKD_HUB_SECRET) is used as it is. Without one
the key lives in the database (``hub_secrets``), so every ``forkd hub serve`` on that
database signs and checks with the same key whatever its data directory: a token one
replica issued is good on the others. The first process to start creates it (an insert
that loses to a concurrent one reads the winner's); a hub that kept its key in
``DATA/token-secret`` before (one replica) carries that key into the database, so
tokens and sessions already handed out stay valid.
"""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from forkd.hub.db import Database
from forkd.hub.models import HubSecret
from forkd.hub.settings import HubSettings

TOKEN_KEY = "token"


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
