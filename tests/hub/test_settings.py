"""Settings are validated when the hub starts, with messages that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.errors import InvalidInput
from forkd.hub.settings import HubSettings, parse_listen


def test_defaults_and_database_urls(tmp_path: Path) -> None:
    s = HubSettings(tmp_path).validated()
    assert s.database_url == f"sqlite+aiosqlite:///{tmp_path.resolve()}/hub.db"
    pg = HubSettings(tmp_path, database_url="postgresql://u:p@db/hub").validated()
    assert pg.database_url == "postgresql+asyncpg://u:p@db/hub"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"database_url": "mysql://x/y"}, "unsupported database URL"),
        ({"port": 0}, "invalid port"),
        ({"public_url": "ftp://x"}, "invalid public URL"),
        ({"default_visibility": "secret"}, "invalid default visibility"),
        ({"admin_user": "root"}, "set both"),
        ({"admin_user": "root", "admin_password": "short"}, "too short"),
        ({"token_ttl": 0}, "must be > 0"),
    ],
)
def test_invalid_settings_are_refused(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        HubSettings(tmp_path, **kwargs).validated()  # type: ignore[arg-type]


def test_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_HUB_ADMIN_USER", "root")
    monkeypatch.setenv("FORKD_HUB_ADMIN_PASSWORD", "root-password")
    monkeypatch.setenv("FORKD_HUB_DEFAULT_VISIBILITY", "public")
    s = HubSettings.from_env(tmp_path)
    assert (s.admin_user, s.admin_password, s.default_visibility) == (
        "root",
        "root-password",
        "public",
    )
    assert "root-password" not in repr(s)


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_listen(":5001") == ("127.0.0.1", 5001)
    with pytest.raises(InvalidInput):
        parse_listen("localhost")
