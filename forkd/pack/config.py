"""The config blob of a pack layer: what it is, where it came from, what it needs to run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError, InvalidInput
from forkd.names import parse_ref, validate_line

CONFIG_SCHEMA = 1
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Compat:
    """What a host must honour to restore the snapshot (checked before any VM starts)."""

    vmm: str
    vmm_version: str
    machine: str
    cpu_model: str
    accelerators: list[str]
    vcpus: int
    memory_mib: int
    kernel_digest: str | None
    agent_protocol: int


@dataclass(frozen=True)
class Provenance:
    """Where a compacted (flattened) layer came from."""

    from_tag: str
    from_digest: str
    from_depth: int
    reason: str  # "manual" or "auto-depth"


@dataclass(frozen=True)
class SnapshotConfig:
    tag: str
    parent_tag: str | None
    parent_digest: str | None
    depth: int
    memory_size: int
    disk_size: int | None
    page_size: int
    compat: Compat | None
    created_at: str
    description: str = ""
    recipe: dict[str, Any] | None = None
    compacted_from: Provenance | None = None
    schema: int = CONFIG_SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "config") -> SnapshotConfig:
        if len(data) > MAX_CONFIG_BYTES:
            raise IntegrityError(f"{what} is {len(data)} bytes, over {MAX_CONFIG_BYTES}")
        try:
            raw = jsondoc.loads(data, what)
            if raw.get("schema") != CONFIG_SCHEMA:
                raise IntegrityError(
                    f"{what} has schema {raw.get('schema')!r}; this forkd reads schema "
                    f"{CONFIG_SCHEMA} — upgrade forkd"
                )
            compat = Compat(**raw.pop("compat")) if raw.get("compat") else None
            raw.pop("compat", None)
            prov = raw.pop("compacted_from", None)
            cfg = cls(compat=compat, compacted_from=Provenance(**prov) if prov else None, **raw)
        except IntegrityError:
            raise
        except (ValueError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{what} is not a valid forkd snapshot config: {exc}") from exc
        cfg.validate(what)
        return cfg

    def validate(self, what: str = "config") -> None:
        parse_ref(self.tag)
        if self.parent_tag is not None:
            parse_ref(self.parent_tag)
        if self.parent_digest is not None:
            dg.validate(self.parent_digest)
        if (self.parent_digest is None) != (self.depth == 0):
            raise IntegrityError(f"{what}: depth {self.depth} disagrees with the parent edge")
        if self.page_size != 4096 or self.memory_size <= 0 or self.memory_size % 4096:
            raise IntegrityError(f"{what}: memory size must be a positive multiple of 4096")
        for label, value in self._lines():
            if not isinstance(value, str):
                raise IntegrityError(f"{what}: {label} must be text")
            try:
                validate_line(value, f"{what}: {label}")
            except InvalidInput as exc:
                raise IntegrityError(str(exc)) from None

    def _lines(self) -> list[tuple[str, object]]:
        """The config's texts that readers are shown as one line: ``forkd pull``'s warning
        that this host cannot fork it (the compat values), ``forkd inspect``, the hub's
        pages. A pack is anyone's (pulled from a hub): an escape sequence or line break in
        them drove the reader's terminal, or forged lines of its output."""
        out: list[tuple[str, object]] = [
            ("description", self.description),
            ("created_at", self.created_at),
        ]
        if self.compat is not None:
            c = self.compat
            out += [
                ("compat.vmm", c.vmm),
                ("compat.vmm_version", c.vmm_version),
                ("compat.machine", c.machine),
                ("compat.cpu_model", c.cpu_model),
            ]
            accelerators = c.accelerators if isinstance(c.accelerators, list) else [None]
            out += [("compat.accelerators", a) for a in accelerators]
        if self.compacted_from is not None:
            p = self.compacted_from
            out += [
                ("compacted_from.from_tag", p.from_tag),
                ("compacted_from.from_digest", p.from_digest),
                ("compacted_from.reason", p.reason),
            ]
        return out
