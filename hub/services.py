"""The hub's long-lived parts, built once by ``create_app`` and handed to every handler."""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from forkd.audit import Actor, AuditLog, BoundedAudit
from forkd.hub.db import Database
from forkd.hub.login_limit import LoginLimiter
from forkd.hub.manifest_cache import ManifestCache, ManifestSizes
from forkd.hub.observability import Metrics
from forkd.hub.pulls import PullCounter
from forkd.hub.secrets import load_token_key
from forkd.hub.settings import HubSettings
from forkd.hub.shared_uploads import SharedUploads
from forkd.hub.storage import UploadArea
from forkd.hub.tokens import CredentialCache, TokenSigner
from forkd.private import open_to_others
from forkd.store.blobs import BlobStore, FsBlobStore
from forkd.store.s3 import S3BlobStore

# Worker threads that read and parse catalog facts (the UI's layer facts, the API's tag
# sizes), all together: a page parses manifests of up to 4 MiB and image maps of up to
# 4 MiB each (~0.7 s of CPU), never on the event loop nor in anyio's shared pool.
FACTS_READERS = 2


# One client's share of a kind's budget of provoked records: at most 1/PROVOKED_SHARES of
# ``audit_provoked_per_minute`` a minute (at least one), so one client cannot spend the
# budget of everyone else of its kind.
PROVOKED_SHARES = 8
SUPPRESSED = "audit.suppressed"  # the action of the record counting what a budget dropped


IPV6_LIMIT_PREFIX = 64  # the addresses one IPv6 client holds: a /64 is one site's LAN


def limited_address(address: str) -> str:
    """The client an address stands for, in the failed-login limiter (hub/auth.py) and
    in the budgets of provoked audit records (``Provoked``): an IPv4 address as is (an
    IPv4-mapped IPv6 one as its IPv4), an IPv6 address by its /64. A host handed an IPv6
    /64 (every ISP's and cloud's smallest allocation) holds 2**64 addresses: counted one
    by one, each new source address was ``login_fail_limit`` more guesses, or a share of
    the audit budget of its own."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # "unknown", or a test client's name: as it is
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/{IPV6_LIMIT_PREFIX}", strict=False))
    return str(ip)


# Credentials an account is handed (and UI sessions it ends) as often as it asks: the
# ``(grants)`` kind of ``Provoked``, a budget per account.
GRANTS = frozenset({"token", "ui.signin", "ui.signout"})


class Provoked:
    """The audit records that any caller can provoke as often as it likes: refusals
    (``denied``, ``rate-limited``, ``failed``) and what anonymous callers are given
    (registry tokens). At most ``per_minute`` (``audit_provoked_per_minute``) a minute
    of each kind, kept apart so a flood of one kind hides no record of another: refused
    logins, other records of anonymous callers, and records of accounts. Within a kind,
    one client (an account; for logins and anonymous callers, an address) has at most
    1/PROVOKED_SHARES of it, so one client's flood hides no record of another client.
    The credentials accounts are given (``token``: registry tokens, up to 64
    repositories named in each; ``ui.signin``/``ui.signout``: UI sessions, which an
    account opens and closes as often as it posts the forms) are a kind of their own:
    ``per_minute`` a minute for each account, and PROVOKED_SHARES times as many in all;
    a token grants no more than what the account already holds, and what it then pulls
    is not audited either.
    Past the budget they are counted into one ``audit.suppressed`` record (actor
    ``(logins)``, ``-``, ``(accounts)`` or ``(grants)``): a flood cannot fill the disk, and the log
    still says it happened. Writes (what a caller changed) are never bounded:
    ``Hub.audit``."""

    def __init__(self, audit: AuditLog, per_minute: int) -> None:
        share = max(1, per_minute // PROVOKED_SHARES)
        self.logins = BoundedAudit(audit, per_minute, SUPPRESSED, "(logins)", share)
        self.anonymous = BoundedAudit(audit, per_minute, SUPPRESSED, "-", share)
        self.accounts = BoundedAudit(audit, per_minute, SUPPRESSED, "(accounts)", share)
        self.grants = BoundedAudit(
            audit, per_minute * PROVOKED_SHARES, SUPPRESSED, "(grants)", per_minute
        )

    def record(
        self, actor: Actor, ip: str, action: str, target: str, result: str, **detail: Any
    ) -> bool:
        """Write the record unless its kind's budget, or the client's share of it, for
        the minute is spent."""
        client: str
        if action == "login":
            kind, client = self.logins, limited_address(ip)
        elif isinstance(actor, str) or actor.user_id is None:
            kind, client = self.anonymous, limited_address(ip)
        elif action in GRANTS:
            kind, client = self.grants, f"account {actor.user_id}"
        else:
            kind, client = self.accounts, f"account {actor.user_id}"
        return kind.record(actor, ip, action, target, result, client=client, **detail)


class LazyLimiter:
    """An ``anyio.CapacityLimiter`` of ``count`` places, made at first use (in the event
    loop that uses it: one hub, one loop)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._limiter: anyio.CapacityLimiter | None = None

    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.count)
        return self._limiter


@dataclass
class Hub:
    settings: HubSettings
    db: Database
    blobs: BlobStore
    uploads: UploadArea
    limiter: LoginLimiter
    verified: CredentialCache
    signer: TokenSigner
    metrics: Metrics
    audit: AuditLog
    pulls: PullCounter
    # What callers provoke at will (refusals, anonymous token grants): bounded.
    provoked: Provoked = field(init=False)
    # Upload sessions in the bucket and the database, continued by any replica (the S3
    # blob backend; hub/shared_uploads.py). None: sessions are files in ``uploads``.
    shared: SharedUploads | None = None
    manifests: ManifestCache = field(default_factory=ManifestCache)
    # Catalog facts: the threads they are parsed in (UI and API together) and the API's
    # tag sizes by manifest digest (hub/manifest_cache.py).
    readers: LazyLimiter = field(default_factory=lambda: LazyLimiter(FACTS_READERS))
    sizes: ManifestSizes = field(default_factory=ManifestSizes)
    # Server-side compactions running at once (hub/compaction.py); more are refused (429).
    compactions: LazyLimiter = field(default_factory=lambda: LazyLimiter(1))
    # Accounts (user ids; a robot counts as the user who answers for it:
    # ``accounts.answerable_user``) with a compaction request running in this process.
    compacting: set[int] = field(default_factory=set)
    # The HMAC key of bearer tokens and UI sessions: a placeholder until ``load_key``
    # (the app's start) puts the shared one in place (hub/secrets.py); its users follow.
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    rekeyed: list[Callable[[bytes], None]] = field(default_factory=list)
    # Called after a manifest PUT by tag with (repository, tag, digest, parsed manifest);
    # must return at once (the retention rule's compaction queues a job: hub/compaction.py).
    after_push: list[Callable[[str, str, str, dict[str, Any]], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.provoked = Provoked(self.audit, self.settings.audit_provoked_per_minute)

    @classmethod
    def build(cls, settings: HubSettings) -> Hub:
        # 0700: the SQLite database (token and password hashes) and private packs' blobs
        settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        opened = open_to_others(settings.data_dir)
        if opened is not None:
            logging.getLogger("forkd.hub").warning(
                "the data directory %s is %s, and it holds the database and private packs' "
                "blobs: chmod 700 it", settings.data_dir, opened)
        db = Database(settings.database_url)
        placeholder = secrets.token_bytes(32)  # random: nothing signed before the start holds
        blobs = open_blob_store(settings)
        shared = None
        if isinstance(blobs, S3BlobStore):
            shared = SharedUploads(blobs.client, blobs.bucket, blobs.prefix)
        return cls(
            settings=settings,
            db=db,
            blobs=blobs,
            shared=shared,
            uploads=UploadArea(settings.uploads_dir),
            limiter=LoginLimiter(db, settings.login_fail_limit, settings.login_fail_window),
            verified=CredentialCache(),
            signer=TokenSigner(placeholder, settings.service, settings.token_ttl),
            metrics=Metrics(),
            audit=AuditLog(settings.audit_path),
            pulls=PullCounter(),
            key=placeholder,
            compactions=LazyLimiter(settings.compactions_max),
        )

    async def load_key(self) -> None:
        """Put the shared key in place: configured, else the database's (hub/secrets.py)."""
        self.key = await load_token_key(self.db, self.settings)
        self.signer.rekey(self.key)
        self.limiter.rekey(self.key)
        for follow in self.rekeyed:
            follow(self.key)

    async def close(self) -> None:
        await self.pulls.flush(self.db)
        await self.db.close()
        self.audit.close()


def open_blob_store(settings: HubSettings) -> BlobStore:
    """The blob backend the settings name; an S3 bucket is checked here, at start."""
    if settings.blob_backend == "s3":
        from forkd.store.s3 import make_client

        store = S3BlobStore(
            make_client(
                endpoint_url=settings.s3_endpoint_url,
                region=settings.s3_region,
                access_key_id=settings.s3_access_key_id,
                secret_access_key=settings.s3_secret_access_key,
            ),
            settings.s3_bucket,
            settings.s3_prefix,
        )
        store.check()
        return store
    return FsBlobStore(settings.blobs_dir)
