"""TOML recipes: what goes into a guest image and how it is warmed (docs/recipes.md)."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forkd import digest
from forkd.errors import InvalidInput
from forkd.jsondoc import is_integer
from forkd.names import validate_line
from forkd.pack.config import MAX_MEMORY_MIB, MAX_VCPUS

_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.\-]*(=[A-Za-z0-9.+~:\-]+)?$")
_PIP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~ ]*$")
_SUITE_RE = re.compile(r"^[a-z]+$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_MAX_FILE = 16 << 20


@dataclass(frozen=True)
class GuestFile:
    path: str
    content: bytes
    mode: int


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    memory_mib: int = 256
    vcpus: int = 1
    disk_free_mib: int = 64
    tmp_mib: int = 64  # size limit of the guest's /tmp (a RAM-backed tmpfs)
    network: bool = False
    egress: tuple[str, ...] = ()  # default egress of its forks (HOST[:PORT]; needs network)
    apt: tuple[str, ...] = ("python3",)
    pip: tuple[str, ...] = ()
    files: tuple[GuestFile, ...] = ()
    warmup: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, recorded in the snapshot's config (file contents by digest)."""
        d = asdict(self)
        d["files"] = [
            {"path": f.path, "mode": oct(f.mode), "digest": digest.of_bytes(f.content)}
            for f in self.files
        ]
        d["apt"] = list(self.apt)
        d["pip"] = list(self.pip)
        if self.tmp_mib == 64:  # recipes with the default keep the build cache keys they had
            d.pop("tmp_mib")
        if self.egress:
            d["egress"] = list(self.egress)
        else:  # recipes without egress keep the build cache keys they had
            d.pop("egress")
        d.pop("extra")
        return d

    def content_digest(self, salt: str = "") -> str:
        """Digest of everything that changes the built snapshot (build cache key)."""
        body = json.dumps(self.to_dict(), sort_keys=True).encode() + salt.encode()
        return digest.of_bytes(body)


def _bad(src: str, msg: str) -> InvalidInput:
    return InvalidInput(f"recipe {src}: {msg} (see docs/recipes.md)")


def _int(tbl: dict[str, Any], key: str, default: int, lo: int, hi: int, src: str) -> int:
    v = tbl.get(key, default)
    if not is_integer(v, lo, hi):
        raise _bad(src, f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _strlist(tbl: dict[str, Any], key: str, default: tuple[str, ...], rx: re.Pattern[str],
             src: str) -> tuple[str, ...]:
    v = tbl.get(key, list(default))
    if not isinstance(v, list) or not all(isinstance(x, str) and rx.fullmatch(x) for x in v):
        raise _bad(src, f"{key} must be a list of package names, got {v!r}")
    return tuple(v)


def _egress(guest: dict[str, Any], network: bool, src: str) -> tuple[str, ...]:
    """``[guest] egress``: the destinations forks get when `forkd fork` names none."""
    from forkd.engine.egress.child import parse_policy

    v = guest.get("egress", [])
    if v == []:
        return ()
    try:
        policy = parse_policy(v)
    except InvalidInput as e:
        raise _bad(src, f"[guest] egress: {e}") from e
    if not network:
        raise _bad(src, "[guest] egress needs `network = true` (the proxy is reached "
                        "through the guest's network device)")
    return tuple(str(e) for e in policy.entries)


def parse(text: str, *, base_dir: Path | None = None, src: str = "<string>") -> Recipe:
    """Parse and validate a recipe. Relative `source` files resolve against base_dir."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _bad(src, f"not valid TOML: {e}") from e
    known = {"recipe", "guest", "packages", "files", "warmup"}
    unknown = set(doc) - known
    if unknown:
        raise _bad(src, f"unknown table(s) {sorted(unknown)}; allowed: {sorted(known)}")
    meta = doc.get("recipe", {})
    name = meta.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise _bad(src, f"[recipe] name must match {_NAME_RE.pattern}, got {name!r}")
    guest = doc.get("guest", {})
    suite = guest.get("suite", "bookworm")
    if not isinstance(suite, str) or not _SUITE_RE.fullmatch(suite):
        raise _bad(src, f"[guest] suite must be a Debian suite name, got {suite!r}")
    mirror = guest.get("mirror", "http://deb.debian.org/debian")
    if not isinstance(mirror, str) or not re.fullmatch(r"(https?|file)://\S+", mirror, re.ASCII):
        raise _bad(src, f"[guest] mirror must be an http(s):// or file:// URL, got {mirror!r}")
    pkgs = doc.get("packages", {})
    apt = _strlist(pkgs, "apt", ("python3",), _PKG_RE, src)
    if not any(p.split("=")[0] in ("python3", "python3-minimal") for p in apt):
        apt = ("python3", *apt)  # the guest agent is Python
    pip = _strlist(pkgs, "pip", (), _PIP_RE, src)
    files: list[GuestFile] = []
    for path, spec in doc.get("files", {}).items():
        if not path.startswith("/") or ".." in path.split("/"):
            raise _bad(src, f"file path {path!r} must be absolute and without '..'")
        if isinstance(spec, str):
            spec = {"content": spec}
        if not isinstance(spec, dict):
            raise _bad(src, f"file {path!r}: expected a string or a table with content/source")
        mode_s = spec.get("mode", "0644")
        try:
            mode = int(str(mode_s), 8)
        except ValueError as e:
            raise _bad(src, f"file {path!r}: mode {mode_s!r} is not octal") from e
        if "content" in spec:
            content = str(spec["content"]).encode()
        elif "source" in spec:
            p = Path(str(spec["source"]))
            if not p.is_absolute():
                p = (base_dir or Path.cwd()) / p
            if not p.is_file():
                raise _bad(src, f"file {path!r}: source {p} does not exist")
            if p.stat().st_size > _MAX_FILE:
                raise _bad(src, f"file {path!r}: source {p} is larger than 16 MiB")
            content = p.read_bytes()
        else:
            raise _bad(src, f"file {path!r}: needs 'content' or 'source'")
        files.append(GuestFile(path, content, mode))
    warm = doc.get("warmup", {})
    code = warm.get("python", "")
    if not isinstance(code, str):
        raise _bad(src, "[warmup] python must be a string of Python code")
    try:
        compile(code, "<warmup>", "exec")
    except SyntaxError as e:
        raise _bad(src, f"[warmup] python does not compile: {e}") from e
    network = guest.get("network", False)
    if not isinstance(network, bool):
        raise _bad(src, f"[guest] network must be true or false, got {network!r}")
    egress = _egress(guest, network, src)
    desc = meta.get("description", "")
    if not isinstance(desc, str):
        raise _bad(src, "[recipe] description must be a string")
    try:  # the snapshot's config holds it, shown as one line (SnapshotConfig.validate)
        validate_line(desc, "[recipe] description")
    except InvalidInput as e:
        raise _bad(src, str(e)) from None
    return Recipe(
        name=name,
        description=str(desc),
        suite=suite,
        mirror=mirror,
        memory_mib=_int(guest, "memory_mib", 256, 96, MAX_MEMORY_MIB, src),
        vcpus=_int(guest, "vcpus", 1, 1, MAX_VCPUS, src),
        disk_free_mib=_int(guest, "disk_free_mib", 64, 8, 65536, src),
        tmp_mib=_int(guest, "tmp_mib", 64, 1, 65536, src),
        network=network,
        egress=egress,
        apt=apt,
        pip=pip,
        files=tuple(files),
        warmup=code,
    )


def load(path: Path) -> Recipe:
    """A recipe file, or a recipe folder's ``recipe.toml`` (docs/recipes.md)."""
    if path.is_dir():
        path = path / "recipe.toml"
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise InvalidInput(
            f"recipe file {path} does not exist; pass a path to a .toml recipe or to a "
            "folder holding a recipe.toml") from e
    return parse(text, base_dir=path.parent, src=str(path))
