"""The host-side secret store: credentials bound to destinations, never given to a guest.

Layout: ``$FORKD_SECRETS`` (default ``$XDG_CONFIG_HOME/forkd/secrets``, i.e.
``~/.config/forkd/secrets``), a private directory (forkd.private: mode 0700, yours);
one private file ``NAME.json`` per secret (mode 0600), written whole and swapped in by
rename, holding ``{"name", "value", "placeholder", "bindings"}``.

- ``NAME`` is ``[A-Za-z][A-Za-z0-9_]{0,63}`` (an environment-variable name).
- The value is 8-4096 printable ASCII characters (0x20-0x7e) without leading or trailing
  spaces: it is put into HTTP header values, so CR, LF, NUL and other control bytes are
  refused, and it is short enough to never be a common string that a reply contains.
- A binding is an exact ``HOST[:PORT]`` (port default 443; no wildcard): the secret is
  put into requests to that destination only, over TLS only.
- The placeholder is ``forkd-secret-placeholder-<NAME>-<32 hex digits>`` (128 random
  bits), made when the secret is first set and kept when its value is replaced, so a
  running child's environment stays valid across a rotation.
"""

from __future__ import annotations

import json
import os
import secrets as random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from forkd.engine.egress.policy import Destination, parse_destination
from forkd.errors import InvalidInput, NotFound
from forkd.names import matches, shown, whole
from forkd.private import create_private_file, private_dir, read_private_file

SECRET_NAME_RE = whole(r"[A-Za-z][A-Za-z0-9_]{0,63}")
PLACEHOLDER_PREFIX = "forkd-secret-placeholder-"
PLACEHOLDER_RE = whole(rf"{PLACEHOLDER_PREFIX}[A-Za-z][A-Za-z0-9_]{{0,63}}-[0-9a-f]{{32}}")
MIN_VALUE, MAX_VALUE = 8, 4096
MAX_BINDINGS = 16
MAX_SECRET_FILE = 64 << 10


def validate_secret_name(name: str) -> str:
    if not matches(SECRET_NAME_RE, name):
        raise InvalidInput(
            f"invalid secret name {shown(name)}: use 1-64 letters, digits or '_', "
            "starting with a letter (an environment-variable name such as OPENAI_API_KEY)"
        )
    return name


def validate_secret_value(value: str) -> str:
    if not isinstance(value, str) or not (MIN_VALUE <= len(value) <= MAX_VALUE):
        raise InvalidInput(
            f"a secret value must be {MIN_VALUE} to {MAX_VALUE} characters long; "
            "pipe it on stdin, e.g. `printenv OPENAI_API_KEY | forkd secret set ...`"
        )
    if not all(0x20 <= ord(c) <= 0x7E for c in value) or value != value.strip(" "):
        raise InvalidInput(
            "a secret value must be printable ASCII without control characters (no CR, LF, "
            "NUL, tab) and without leading or trailing spaces: it is sent in HTTP headers"
        )
    return value


def parse_bindings(texts: Iterable[str]) -> tuple[Destination, ...]:
    bindings = tuple(sorted({parse_destination(t, wildcard_ok=False) for t in texts}))
    if not bindings:
        raise InvalidInput("bind the secret to at least one destination: --bind HOST[:PORT]")
    if len(bindings) > MAX_BINDINGS:
        raise InvalidInput(f"a secret is bound to at most {MAX_BINDINGS} destinations")
    return bindings


@dataclass(frozen=True)
class Secret:
    name: str
    value: str
    placeholder: str
    bindings: tuple[Destination, ...]

    def __repr__(self) -> str:  # never show the value, in logs or tracebacks
        return f"Secret({self.name!r}, bindings={[str(b) for b in self.bindings]})"

    def bound_to(self, dest: Destination) -> bool:
        return dest in self.bindings


def new_placeholder(name: str) -> str:
    return f"{PLACEHOLDER_PREFIX}{validate_secret_name(name)}-{random.token_hex(16)}"


def secrets_dir() -> Path:
    """$FORKD_SECRETS, else $XDG_CONFIG_HOME/forkd/secrets; made or checked as private."""
    env = os.environ.get("FORKD_SECRETS")
    if env:
        return private_dir(Path(env))
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return private_dir(Path(config) / "forkd" / "secrets", owned_levels=2)


class SecretStore:
    """The secrets in one private directory."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = private_dir(root) if root is not None else secrets_dir()

    def _path(self, name: str) -> Path:
        return self.root / f"{validate_secret_name(name)}.json"

    def set(self, name: str, value: str, bindings: Iterable[str]) -> Secret:
        """Store (or replace) ``name``; a replaced secret keeps its placeholder."""
        path = self._path(name)
        value = validate_secret_value(value)
        bound = parse_bindings(bindings)
        placeholder = self.get(name).placeholder if path.exists() else new_placeholder(name)
        secret = Secret(name, value, placeholder, bound)
        doc = {
            "name": name,
            "value": value,
            "placeholder": placeholder,
            "bindings": [str(b) for b in bound],
        }
        tmp = self.root / f".{name}.{random.token_hex(8)}.new"
        if not create_private_file(tmp, json.dumps(doc).encode()):
            raise InvalidInput(f"{tmp} exists; remove it and retry")
        os.rename(tmp, path)  # atomic swap; tmp is our own fresh 0600 file
        return secret

    def get(self, name: str) -> Secret:
        path = self._path(name)
        if not os.path.lexists(path):
            raise NotFound(f"no secret named {name!r}; `forkd secret ls` lists them")
        return self._load(path, name)

    def _load(self, path: Path, name: str) -> Secret:
        raw = read_private_file(path, MAX_SECRET_FILE)
        fix = f"remove it with `forkd secret rm {name}` and set it again"
        try:
            doc = json.loads(raw)
            secret = Secret(
                validate_secret_name(doc["name"]),
                validate_secret_value(doc["value"]),
                doc["placeholder"],
                parse_bindings(doc["bindings"]),
            )
        except (ValueError, KeyError, TypeError, InvalidInput) as exc:
            raise InvalidInput(f"{path} is not a forkd secret file ({exc}); {fix}") from None
        if secret.name != name or not matches(PLACEHOLDER_RE, secret.placeholder):
            raise InvalidInput(f"{path} names another secret or a bad placeholder; {fix}")
        return secret

    def names(self) -> list[str]:
        found = []
        for entry in os.listdir(self.root):
            stem, dot, ext = entry.rpartition(".")
            if dot and ext == "json" and matches(SECRET_NAME_RE, stem):
                found.append(stem)
        return sorted(found)

    def all(self) -> list[Secret]:
        return [self.get(name) for name in self.names()]

    def remove(self, name: str) -> None:
        path = self._path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            raise NotFound(f"no secret named {name!r}; `forkd secret ls` lists them") from None


def guest_environment(secrets: Iterable[Secret]) -> dict[str, str]:
    """``{NAME: placeholder}``: what a guest may see, to export into its environment."""
    return {s.name: s.placeholder for s in secrets}
