"""The hub's long-lived parts, built once by ``create_app`` and handed to every handler."""

from __future__ import annotations

from dataclasses import dataclass

from forkd.audit import AuditLog
from forkd.hub.db import Database
from forkd.hub.observability import Metrics
from forkd.hub.pulls import PullCounter
from forkd.hub.settings import HubSettings
from forkd.hub.storage import UploadArea
from forkd.hub.tokens import CredentialCache, LoginLimiter, TokenSigner
from forkd.store.blobs import BlobStore, FsBlobStore


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

    @classmethod
    def build(cls, settings: HubSettings) -> Hub:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        return cls(
            settings=settings,
            db=Database(settings.database_url),
            blobs=FsBlobStore(settings.blobs_dir),
            uploads=UploadArea(settings.uploads_dir),
            limiter=LoginLimiter(settings.login_fail_limit, settings.login_fail_window),
            verified=CredentialCache(),
            signer=TokenSigner(settings.token_secret(), settings.service, settings.token_ttl),
            metrics=Metrics(),
            audit=AuditLog(settings.audit_path),
            pulls=PullCounter(),
        )

    async def close(self) -> None:
        await self.pulls.flush(self.db)
        await self.db.close()
        self.audit.close()
