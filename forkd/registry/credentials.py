"""The client's files: hub credentials and the client config (the default hub).

Both live in one directory, ``$XDG_CONFIG_HOME/forkd/`` (``~/.config/forkd/``), or the
directory of ``$FORKD_CREDENTIALS`` when that is set: ``credentials.json`` and
``config.json``, each mode 0600 and replaced atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.errors import InvalidInput
from forkd.names import shown

CONFIG_FILE = "config.json"
MAX_CLIENT_FILE = 1 << 20  # credentials and config are small; a bigger file is not ours
SET_BY = ("user", "quickstart")  # who stored the default hub


@dataclass(frozen=True)
class Credential:
    username: str
    secret: str  # a password or a token
    # the scheme ``forkd login`` checked it over: a credential checked over https is never
    # sent over plain http (RegistryClient), where anyone on the path reads it. None: an
    # entry stored before the scheme was recorded, taken as the host's default scheme.
    scheme: str | None = None


def credentials_path() -> Path:
    env = os.environ.get("FORKD_CREDENTIALS")
    if env:
        return Path(env)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "forkd" / "credentials.json"


def config_path() -> Path:
    """The client config file, next to the credentials file."""
    creds = credentials_path()
    if creds.name == CONFIG_FILE:
        raise InvalidInput(
            f"FORKD_CREDENTIALS={creds} is named {CONFIG_FILE}, the name of the client config "
            "file kept next to it: name the credentials file something else"
        )
    return creds.with_name(CONFIG_FILE)


@dataclass(frozen=True)
class StoredHub:
    """The default hub as the config file holds it (not yet validated as an address)."""

    address: str
    set_by: str  # "user" (forkd config set hub, forkd login --default) or "quickstart"


def _read(path: Path, fix: str = "delete it and log in again") -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CLIENT_FILE + 1)
    except FileNotFoundError:
        return {}
    if len(data) > MAX_CLIENT_FILE:
        raise InvalidInput(f"{path} is larger than {MAX_CLIENT_FILE} bytes; {fix}")
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise InvalidInput(f"{path} is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path} is malformed; {fix}")
    return raw


def load(hub: str) -> Credential | None:
    path = credentials_path()
    entry = _read(path).get(hub)
    if not entry:
        return None
    if not isinstance(entry, dict) or "username" not in entry or "secret" not in entry:
        raise InvalidInput(f"{path}: the entry for {shown(hub)} is malformed; run "
                           f"`forkd login {shown(hub)}` again (or `forkd logout` it)")
    scheme = entry.get("scheme")
    return Credential(str(entry["username"]), str(entry["secret"]),
                      scheme if scheme in ("http", "https") else None)


def save(hub: str, credential: Credential) -> Path:
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = _read(path)
    data[hub] = {"username": credential.username, "secret": credential.secret}
    if credential.scheme is not None:
        data[hub]["scheme"] = credential.scheme
    _write(path, data)
    return path


def forget(hub: str) -> bool:
    path = credentials_path()
    data = _read(path)
    if data.pop(hub, None) is None:
        return False
    _write(path, data)
    return True


_CONFIG_FIX = "fix it, or delete it and run `forkd config set hub HOST[:PORT]`"


def load_default_hub() -> StoredHub | None:
    """The default hub stored in the config file, or None; its address is checked by
    ``forkd.registry.reference.configured_hub``."""
    path = config_path()
    entry = _read(path, _CONFIG_FIX).get("default_hub")
    if entry is None:
        return None
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("address"), str)
        or entry.get("set_by") not in SET_BY
    ):
        raise InvalidInput(f"{path}: default_hub is malformed; {_CONFIG_FIX}")
    return StoredHub(entry["address"], entry["set_by"])


def save_default_hub(address: str, set_by: str) -> Path:
    """Store ``address`` (already validated by the caller) as the default hub."""
    if set_by not in SET_BY:
        raise ValueError(f"set_by must be one of {SET_BY}, got {set_by!r}")
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = _read(path, _CONFIG_FIX)
    data["default_hub"] = {"address": address, "set_by": set_by}
    _write(path, data)
    return path


def forget_default_hub() -> bool:
    path = config_path()
    data = _read(path, _CONFIG_FIX)
    if data.pop("default_hub", None) is None:
        return False
    _write(path, data)
    return True


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file atomically; it is never readable by others, not even briefly."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
