"""Hub settings: one dataclass, read from arguments and the environment, validated at start."""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from forkd.errors import InvalidInput

MiB = 1 << 20
SQLITE_PREFIX = "sqlite+aiosqlite:///"
POSTGRES_PREFIX = "postgresql+asyncpg://"
VISIBILITIES = ("public", "private")


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
    token_ttl: int = 300
    admin_user: str = ""
    admin_password: str = field(default="", repr=False)
    default_visibility: str = "private"
    manifest_max_bytes: int = 4 * MiB
    login_fail_limit: int = 10
    login_fail_window: float = 300.0
    migrate_on_start: bool = True

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
        if bool(self.admin_user) != bool(self.admin_password):
            raise InvalidInput(
                "set both FORKD_HUB_ADMIN_USER and FORKD_HUB_ADMIN_PASSWORD, or neither"
            )
        return HubSettings(
            data_dir=data_dir,
            database_url=url,
            host=self.host,
            port=self.port,
            public_url=self.public_url.rstrip("/"),
            service=self.service,
            secret=self.secret,
            token_ttl=self.token_ttl,
            admin_user=self.admin_user,
            admin_password=self.admin_password,
            default_visibility=self.default_visibility,
            manifest_max_bytes=self.manifest_max_bytes,
            login_fail_limit=self.login_fail_limit,
            login_fail_window=self.login_fail_window,
            migrate_on_start=self.migrate_on_start,
        )

    # -- layout of the data directory (owned here) ---------------------------
    @property
    def blobs_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def audit_path(self) -> Path:
        return self.data_dir / "audit.log"

    @property
    def secret_file(self) -> Path:
        return self.data_dir / "token-secret"

    def token_secret(self) -> bytes:
        """The bearer-token key: configured, or generated once and kept in the data dir (0600)."""
        if self.secret:
            return self.secret.encode()
        path = self.secret_file
        try:
            return path.read_bytes().strip()
        except FileNotFoundError:
            pass
        self.data_dir.mkdir(parents=True, exist_ok=True)
        key = secrets.token_hex(32).encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process won the race
            return path.read_bytes().strip()
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key


ENV_KEYS = {
    "data_dir": "FORKD_HUB_DATA",
    "database_url": "FORKD_HUB_DATABASE_URL",
    "public_url": "FORKD_HUB_PUBLIC_URL",
    "secret": "FORKD_HUB_SECRET",
    "admin_user": "FORKD_HUB_ADMIN_USER",
    "admin_password": "FORKD_HUB_ADMIN_PASSWORD",
    "default_visibility": "FORKD_HUB_DEFAULT_VISIBILITY",
}
_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "Path": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


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
        expected = _TYPES.get(types.get(key, ""))
        if expected is None:
            raise InvalidInput(
                f"{path}: unknown setting {key!r}; known: listen, " + ", ".join(sorted(types))
            )
        if not isinstance(value, expected) or (bool not in expected and isinstance(value, bool)):
            raise InvalidInput(f"{path}: {key} must be of type {types[key]}, not {value!r}")
        values[key] = value
    return values


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``) → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidInput(f"invalid listen address {text!r}: use HOST:PORT, e.g. 127.0.0.1:5000")
    return host or "127.0.0.1", int(port)
