"""Hub settings: one dataclass, read from arguments and the environment, validated at start."""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from forkd.errors import InvalidInput
from forkd.pack.chain import MAX_CHAIN_DEPTH

MiB = 1 << 20
SQLITE_PREFIX = "sqlite+aiosqlite:///"
POSTGRES_PREFIX = "postgresql+asyncpg://"
VISIBILITIES = ("public", "private")
BLOB_BACKENDS = ("fs", "s3")
MIN_METRICS_TOKEN = 16
MAX_COMPACTIONS = 16  # compactions_max: each one may write 16 GiB and keep a core busy
# What a Host header (and an ``allowed_hosts`` entry) may be: a DNS name (labels of
# letters, digits, '-' and '_', as compose service names use), an IPv4 address or an
# IPv6 literal in brackets, then an optional port; no user info, path or quote, so a
# URL built from it (the token realm) is that host's and nothing else.
HOST_RE = re.compile(
    r"(?P<name>[a-z0-9_-]{1,63}(?:\.[a-z0-9_-]{1,63})*\.?|\[[0-9a-f:.]{2,45}\])"
    r"(?::(?P<port>[0-9]{1,5}))?",
    re.ASCII | re.IGNORECASE,
)


def parse_host(text: str) -> tuple[str, str] | None:
    """``text`` as a ``HOST_RE`` authority, lowercase, and its host without the port (the
    port at most 65535: Litestar's URL of a request with a larger one raises); else None."""
    m = HOST_RE.fullmatch(text)
    if m is None or (m["port"] is not None and int(m["port"]) > 65535):
        return None
    return text.lower(), m["name"].lower()


@dataclass(frozen=True)
class RetentionRule:
    """Which tags of the repositories matching ``repositories`` (an fnmatch glob on full
    names) a retention sweep keeps: the ``keep_last`` most recently pushed, and/or those
    pulled within ``pulled_within_days`` (a tag never pulled counts from its push)."""

    repositories: str
    keep_last: int | None = None
    pulled_within_days: float | None = None

    def validated(self) -> RetentionRule:
        if not isinstance(self.repositories, str) or not self.repositories:
            raise InvalidInput('a retention rule needs repositories = "GLOB" (e.g. "acme/*")')
        if self.keep_last is None and self.pulled_within_days is None:
            raise InvalidInput(
                f"retention rule for {self.repositories!r} keeps everything: set keep_last "
                "and/or pulled_within_days"
            )
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool)
            or not isinstance(self.keep_last, int)
            or self.keep_last < 1
        ):
            raise InvalidInput(
                f"retention keep_last must be an integer >= 1, not {self.keep_last!r}"
            )
        days = self.pulled_within_days
        if days is not None and (
            isinstance(days, bool) or not isinstance(days, int | float) or days <= 0
        ):
            raise InvalidInput(f"retention pulled_within_days must be > 0, not {days!r}")
        return self


# One client holds at most this part of the request and response bodies budgets
# (hub/body_budget.py): a few clients (an attacker's addresses) cannot hold all of it and
# so refuse everyone else.
CLIENT_PARTS = 8


@dataclass(frozen=True)
class HubSettings:
    """Everything the hub needs to start; ``from_env`` or direct, then ``validated``."""

    data_dir: Path
    database_url: str = ""
    host: str = "127.0.0.1"
    port: int = 5000
    public_url: str = ""  # base URL clients see (token realm); derived per request when empty
    service: str = "forkd-hub"
    secret: str = field(default="", repr=False)  # HMAC key for bearer tokens
    # What a scraper sends as ``Authorization: Bearer`` to read /metrics (site admins
    # may too); empty: only site admins (app.py ``metrics``).
    metrics_token: str = field(default="", repr=False)
    token_ttl: int = 300
    admin_user: str = ""
    admin_password: str = field(default="", repr=False)
    default_visibility: str = "private"
    manifest_max_bytes: int = 4 * MiB
    login_fail_limit: int = 10
    login_fail_window: float = 300.0
    # Reverse proxies (IPs or CIDRs, comma-separated) whose X-Forwarded-For names the
    # client; from anyone else the header is ignored (hub/auth.py ``client_ip``).
    trusted_proxies: str = ""
    # Host names (optionally HOST:PORT, comma-separated) a request's Host header may name;
    # any other is 400 (hub/auth.py ``check_host``). Empty: any well-formed Host.
    allowed_hosts: str = ""
    # Blob storage: "fs" (DATA/blobs) or "s3" (forkd.store.s3). S3 credentials left empty
    # come from the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profile, role).
    blob_backend: str = "fs"
    s3_bucket: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else e.g. http://minio:9000
    s3_region: str = ""
    s3_prefix: str = ""  # keys go under PREFIX/blobs/sha256/…
    s3_access_key_id: str = field(default="", repr=False)
    s3_secret_access_key: str = field(default="", repr=False)
    migrate_on_start: bool = True
    # Retention: a tag pushed with a chain deeper than this is compacted on the hub into
    # TAG-flat, in the background (hub/compaction.py); 0 turns the rule off.
    compact_deeper_than: int = 0
    # Retention rules ([[retention]] tables in the config file; the first rule whose glob
    # matches a repository applies) and how often the background sweep runs (seconds).
    retention: tuple[RetentionRule, ...] = ()
    retention_interval: float = 3600.0
    # Upload sessions (hub/oci/uploads.py): at most this many open per namespace, and per
    # user across all namespaces, each at most upload_max_bytes, dropped after
    # upload_idle_timeout seconds without a PATCH/PUT (the hub's periodic sweep and
    # `forkd hub gc` delete their files).
    upload_sessions_max: int = 50
    upload_sessions_per_user: int = 20
    upload_max_bytes: int = 16 * 1024 * MiB
    upload_idle_timeout: float = 3600.0
    # Server-side compactions (hub/compaction.py) running at once, the retention rule's
    # included: each may write up to 16 GiB of assembled images. A POST /api/v1/compact
    # finding them all busy is refused with 429 and Retry-After, never queued.
    compactions_max: int = 2
    # Repositories per namespace: a push member creates one by starting an upload to a
    # new name (kept however the upload ends); past this, a new name is 403 DENIED.
    repositories_max: int = 10_000
    # Tags per repository: a tag costs no quota (many can name one manifest), so without
    # a bound one push member could add rows without end; past it a new tag is 403.
    tags_max: int = 100_000
    # Manifests per repository, tagged or not: a manifest pushed by digest needs no tag, and
    # without a quota it costs nothing, so one push member added rows without end; past it
    # a new manifest is 403 (re-pushing one the repository holds always works).
    manifests_max: int = 100_000
    # Audit records that callers provoke at will (refusals, anonymous registry tokens),
    # per minute, for refused logins, other anonymous records and accounts' each
    # (hub/services.py ``Provoked``); past it they are counted in ``audit.suppressed``.
    audit_provoked_per_minute: int = 120
    # Bytes of request bodies the hub holds in memory at once (manifests, API and UI
    # bodies are read whole before their handler runs; blob uploads stream to storage and
    # are not counted), one client (an address; IPv6 by its /64) at most 1/8 of it:
    # past that 429, past the whole 503, before the body is read (hub/body_budget.py).
    request_bodies_max: int = 256 * MiB
    # Bytes of responses being sent at once (a blob's chunk, a manifest, a page, from
    # the hub's memory to a client reading at its own pace), one client at most 1/8 of
    # it: a response past that is cut short of its Content-Length (hub/body_budget.py).
    response_bytes_max: int = 512 * MiB

    @classmethod
    def from_env(
        cls,
        data_dir: Path | None = None,
        *,
        base: Mapping[str, object] | None = None,
        **overrides: object,
    ) -> HubSettings:
        """Defaults ← ``base`` (a config file) ← FORKD_HUB_* environment ← explicit arguments."""
        values: dict[str, object] = {"data_dir": Path("./hub-data"), **(base or {})}
        for key, var in ENV_KEYS.items():
            if var in os.environ:
                values[key] = os.environ[var]
        if data_dir is not None:
            values["data_dir"] = data_dir
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["data_dir"] = Path(str(values["data_dir"]))
        return cls(**values).validated()  # type: ignore[arg-type]

    def validated(self) -> HubSettings:
        """Return a copy with defaults filled in; raise InvalidInput on anything unusable."""
        data_dir = self.data_dir.resolve()
        url = self.database_url or f"{SQLITE_PREFIX}{data_dir / 'hub.db'}"
        if url.startswith(("postgresql://", "postgres://")):
            url = POSTGRES_PREFIX + url.split("://", 1)[1]
        if not url.startswith((SQLITE_PREFIX, POSTGRES_PREFIX)):
            raise InvalidInput(
                f"unsupported database URL {url.split(':', 1)[0]!r}: use sqlite+aiosqlite:///PATH "
                "or postgresql://USER:PASS@HOST/DB"
            )
        if not 0 < self.port < 65536:
            raise InvalidInput(f"invalid port {self.port}: use 1-65535")
        if self.public_url:
            parts = urlsplit(self.public_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise InvalidInput(f"invalid public URL {self.public_url!r}: use http(s)://HOST")
        if self.default_visibility not in VISIBILITIES:
            raise InvalidInput(
                f"invalid default visibility {self.default_visibility!r}: use public or private"
            )
        if self.token_ttl <= 0 or self.manifest_max_bytes <= 0 or self.login_fail_limit <= 0:
            raise InvalidInput("token_ttl, manifest_max_bytes and login_fail_limit must be > 0")
        if not 0 <= self.compact_deeper_than <= MAX_CHAIN_DEPTH:
            raise InvalidInput(
                f"compact_deeper_than must be 0 (off) to {MAX_CHAIN_DEPTH}, "
                f"not {self.compact_deeper_than}"
            )
        self._check_blob_backend()
        for rule in self.retention:
            rule.validated()
        if self.retention_interval <= 0:
            raise InvalidInput("retention_interval must be > 0 seconds")
        if min(self.upload_sessions_max, self.upload_sessions_per_user, self.upload_max_bytes) <= 0:
            raise InvalidInput(
                "upload_sessions_max, upload_sessions_per_user and upload_max_bytes must be > 0"
            )
        if min(self.repositories_max, self.tags_max, self.manifests_max) <= 0:
            raise InvalidInput("repositories_max, tags_max and manifests_max must be > 0")
        if self.audit_provoked_per_minute <= 0:
            raise InvalidInput("audit_provoked_per_minute must be > 0")
        if self.request_bodies_max < CLIENT_PARTS * self.manifest_max_bytes:
            raise InvalidInput(
                f"request_bodies_max ({self.request_bodies_max}) must be at least {CLIENT_PARTS} "
                f"times manifest_max_bytes ({self.manifest_max_bytes}): one client may hold "
                f"1/{CLIENT_PARTS} of it, and must be able to push its largest manifest"
            )
        if self.response_bytes_max < CLIENT_PARTS * self.manifest_max_bytes:
            raise InvalidInput(
                f"response_bytes_max ({self.response_bytes_max}) must be at least {CLIENT_PARTS} "
                f"times manifest_max_bytes ({self.manifest_max_bytes}): one client may hold "
                f"1/{CLIENT_PARTS} of it, and must be able to pull its largest manifest"
            )
        if self.upload_idle_timeout <= 0:
            raise InvalidInput("upload_idle_timeout must be > 0 seconds")
        if not 1 <= self.compactions_max <= MAX_COMPACTIONS:
            raise InvalidInput(
                f"compactions_max must be 1 to {MAX_COMPACTIONS}, not {self.compactions_max}"
            )
        if self.metrics_token and (
            len(self.metrics_token) < MIN_METRICS_TOKEN or not self.metrics_token.isprintable()
        ):
            raise InvalidInput(
                f"metrics_token (FORKD_HUB_METRICS_TOKEN) must be at least {MIN_METRICS_TOKEN} "
                "printable characters, e.g. from `openssl rand -hex 32`"
            )
        if bool(self.admin_user) != bool(self.admin_password):
            raise InvalidInput(
                "set both FORKD_HUB_ADMIN_USER and FORKD_HUB_ADMIN_PASSWORD, or neither"
            )
        if self.admin_password:  # refuse at start, not in the middle of the app's startup
            from forkd.hub.accounts import check_password

            check_password(self.admin_password, "FORKD_HUB_ADMIN_PASSWORD")
        return HubSettings(
            data_dir=data_dir,
            database_url=url,
            host=self.host,
            port=self.port,
            public_url=self.public_url.rstrip("/"),
            service=self.service,
            secret=self.secret,
            metrics_token=self.metrics_token,
            token_ttl=self.token_ttl,
            admin_user=self.admin_user,
            admin_password=self.admin_password,
            default_visibility=self.default_visibility,
            manifest_max_bytes=self.manifest_max_bytes,
            login_fail_limit=self.login_fail_limit,
            login_fail_window=self.login_fail_window,
            trusted_proxies=",".join(str(n) for n in proxy_networks(self.trusted_proxies)),
            allowed_hosts=",".join(sorted(host_names(self.allowed_hosts))),
            blob_backend=self.blob_backend,
            s3_bucket=self.s3_bucket,
            s3_endpoint_url=self.s3_endpoint_url.rstrip("/"),
            s3_region=self.s3_region,
            s3_prefix=self.s3_prefix.strip("/"),
            s3_access_key_id=self.s3_access_key_id,
            s3_secret_access_key=self.s3_secret_access_key,
            migrate_on_start=self.migrate_on_start,
            compact_deeper_than=self.compact_deeper_than,
            retention=tuple(self.retention),
            retention_interval=float(self.retention_interval),
            upload_sessions_max=self.upload_sessions_max,
            upload_sessions_per_user=self.upload_sessions_per_user,
            upload_max_bytes=self.upload_max_bytes,
            upload_idle_timeout=float(self.upload_idle_timeout),
            audit_provoked_per_minute=self.audit_provoked_per_minute,
            request_bodies_max=self.request_bodies_max,
            response_bytes_max=self.response_bytes_max,
            compactions_max=self.compactions_max,
            repositories_max=self.repositories_max,
            tags_max=self.tags_max,
            manifests_max=self.manifests_max,
        )

    def _check_blob_backend(self) -> None:
        """The blob backend's settings are complete and used (none silently ignored)."""
        if self.blob_backend not in BLOB_BACKENDS:
            raise InvalidInput(f"invalid blob backend {self.blob_backend!r}: use fs or s3")
        s3_set = [
            name
            for name in ("s3_bucket", "s3_endpoint_url", "s3_region", "s3_prefix")
            if getattr(self, name)
        ]
        if self.s3_access_key_id or self.s3_secret_access_key:
            s3_set.append("s3 credentials")
        if self.blob_backend != "s3":
            if s3_set:
                raise InvalidInput(
                    f"{', '.join(s3_set)} set but the blob backend is {self.blob_backend!r}: "
                    'set blob_backend = "s3" (--blob-backend s3) or remove them'
                )
            return
        if not self.s3_bucket:
            raise InvalidInput(
                "the s3 blob backend needs a bucket: --s3-bucket, FORKD_HUB_S3_BUCKET or s3_bucket"
            )
        if self.s3_endpoint_url:
            parts = urlsplit(self.s3_endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise InvalidInput(
                    f"invalid S3 endpoint {self.s3_endpoint_url!r}: use http(s)://HOST[:PORT]"
                )
        if ".." in self.s3_prefix.split("/"):
            raise InvalidInput(f"invalid S3 prefix {self.s3_prefix!r}: no '..' components")
        if bool(self.s3_access_key_id) != bool(self.s3_secret_access_key):
            raise InvalidInput(
                "set both s3_access_key_id and s3_secret_access_key, or neither (then the "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY environment or an AWS profile is used)"
            )

    # -- layout of the data directory (owned here) ---------------------------
    @property
    def blobs_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def blob_directory_id_file(self) -> Path:
        """This data directory's id, recorded in the database (hub/secrets.py)."""
        return self.data_dir / "blobs-id"

    @property
    def audit_path(self) -> Path:
        return self.data_dir / "audit.log"

    @property
    def secret_file(self) -> Path:
        """Where a hub before migration 0009 kept its generated key (hub/secrets.py)."""
        return self.data_dir / "token-secret"


ENV_KEYS = {
    "data_dir": "FORKD_HUB_DATA",
    "database_url": "FORKD_HUB_DATABASE_URL",
    "public_url": "FORKD_HUB_PUBLIC_URL",
    "secret": "FORKD_HUB_SECRET",
    "metrics_token": "FORKD_HUB_METRICS_TOKEN",
    "admin_user": "FORKD_HUB_ADMIN_USER",
    "admin_password": "FORKD_HUB_ADMIN_PASSWORD",
    "default_visibility": "FORKD_HUB_DEFAULT_VISIBILITY",
    "trusted_proxies": "FORKD_HUB_TRUSTED_PROXIES",
    "allowed_hosts": "FORKD_HUB_ALLOWED_HOSTS",
    "blob_backend": "FORKD_HUB_BLOB_BACKEND",
    "s3_bucket": "FORKD_HUB_S3_BUCKET",
    "s3_endpoint_url": "FORKD_HUB_S3_ENDPOINT_URL",
    "s3_region": "FORKD_HUB_S3_REGION",
    "s3_prefix": "FORKD_HUB_S3_PREFIX",
}
_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "Path": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.lru_cache(maxsize=8)
def proxy_networks(text: str) -> tuple[Network, ...]:
    """``trusted_proxies`` parsed: ``"10.0.0.5, 192.168.0.0/24"`` → networks."""
    out: list[Network] = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise InvalidInput(
                f"invalid trusted proxy {item[:60]!r}: use IP addresses or CIDRs, "
                "comma-separated (e.g. 10.0.0.5,192.168.0.0/24)"
            ) from exc
    return tuple(out)


@functools.lru_cache(maxsize=8)
def host_names(text: str) -> frozenset[str]:
    """``allowed_hosts`` parsed: ``"hub.example.com, hub:5000"`` → lowercase entries."""
    out = set()
    for item in text.replace(" ", "").lower().split(","):
        if not item:
            continue
        if parse_host(item) is None:
            raise InvalidInput(
                f"invalid allowed host {item[:60]!r}: use host names or HOST:PORT, "
                "comma-separated (e.g. hub.example.com,10.0.0.5:5000)"
            )
        out.add(item)
    return frozenset(out)


def load_config(path: Path) -> dict[str, object]:
    """Read a TOML config file whose keys are HubSettings fields (plus ``listen``).

    Unknown keys and values of the wrong type are errors, never silently ignored.
    """
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidInput(f"cannot read hub config {path}: {exc}") from exc
    types = {f.name: str(f.type) for f in fields(HubSettings)}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key == "listen" and isinstance(value, str):
            values["host"], values["port"] = parse_listen(value)
            continue
        if key == "retention":
            values["retention"] = _retention_rules(path, value)
            continue
        expected = _TYPES.get(types.get(key, ""))
        if expected is None:
            raise InvalidInput(
                f"{path}: unknown setting {key!r}; known: listen, " + ", ".join(sorted(types))
            )
        if not isinstance(value, expected) or (bool not in expected and isinstance(value, bool)):
            raise InvalidInput(f"{path}: {key} must be of type {types[key]}, not {value!r}")
        values[key] = value
    return values


RULE_KEYS = {"repositories", "keep_last", "pulled_within_days"}


def _retention_rules(path: Path, value: object) -> tuple[RetentionRule, ...]:
    """``[[retention]]`` tables: repositories = GLOB, keep_last = N, pulled_within_days = D."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidInput(f"{path}: retention must be [[retention]] tables")
    rules = []
    for table in value:
        unknown = set(table) - RULE_KEYS
        if unknown:
            raise InvalidInput(
                f"{path}: unknown retention key(s) {', '.join(sorted(unknown))}; known: "
                + ", ".join(sorted(RULE_KEYS))
            )
        try:
            rules.append(RetentionRule(**table).validated())
        except InvalidInput as exc:
            raise InvalidInput(f"{path}: {exc}") from exc
    return tuple(rules)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``) → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidInput(f"invalid listen address {text!r}: use HOST:PORT, e.g. 127.0.0.1:5000")
    return host or "127.0.0.1", int(port)
