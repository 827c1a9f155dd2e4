"""Stored hub credentials: ``$XDG_CONFIG_HOME/forkd/credentials.json`` (mode 0600)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forkd.errors import InvalidInput


@dataclass(frozen=True)
class Credential:
    username: str
    secret: str  # a password or a token


def credentials_path() -> Path:
    env = os.environ.get("FORKD_CREDENTIALS")
    if env:
        return Path(env)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "forkd" / "credentials.json"


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise InvalidInput(f"{path} is not valid JSON ({exc}); delete it and log in again") from exc
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path} is malformed; delete it and log in again")
    return raw


def load(hub: str) -> Credential | None:
    entry = _read(credentials_path()).get(hub)
    if not entry:
        return None
    return Credential(str(entry["username"]), str(entry["secret"]))


def save(hub: str, credential: Credential) -> Path:
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = _read(path)
    data[hub] = {"username": credential.username, "secret": credential.secret}
    _write(path, data)
    return path


def forget(hub: str) -> bool:
    path = credentials_path()
    data = _read(path)
    if data.pop(hub, None) is None:
        return False
    _write(path, data)
    return True


def _write(path: Path, data: dict[str, dict[str, str]]) -> None:
    """Replace the file atomically; it is never readable by others, not even briefly."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".credentials-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
