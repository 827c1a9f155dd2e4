"""The config blob of a pack layer: what it is, where it came from, what it needs to run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError, InvalidInput
from forkd.names import parse_ref, validate_line
from forkd.pack.imagemap import MAX_IMAGE_SIZE

CONFIG_SCHEMA = 1
MAX_CONFIG_BYTES = 1 << 20
# A config's numbers are its pusher's words, read by the engine (QEMU's -smp and -m) and
# shown to users: each must be an integer (not a bool, a float or a text) in these bounds.
MAX_VCPUS = 64  # what a recipe may ask for ([guest] vcpus)
MAX_MEMORY_MIB = 65536  # and [guest] memory_mib: QEMU's -m for every fork of the snapshot
MAX_DEPTH = 64  # forkd.pack.chain.MAX_CHAIN_DEPTH (chain imports this module, so not from it)
MAX_PROTOCOL = 1 << 16  # a guest agent protocol number


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
        """IntegrityError unless every field has its type and bounds (InvalidInput for a
        tag or digest text that is not one): a pulled config is anyone's, and its values
        reach QEMU's command line, the user's terminal and the store's arithmetic."""
        parse_ref(_text(self.tag, "tag", what))
        if self.parent_tag is not None:
            parse_ref(_text(self.parent_tag, "parent_tag", what))
        if self.parent_digest is not None:
            dg.validate(_text(self.parent_digest, "parent_digest", what))
        _integer(self.depth, "depth", what, 0, MAX_DEPTH)
        if (self.parent_digest is None) != (self.depth == 0):
            raise IntegrityError(f"{what}: depth {self.depth} disagrees with the parent edge")
        _integer(self.memory_size, "memory_size", what, 4096, MAX_IMAGE_SIZE)
        if self.page_size != 4096 or self.memory_size % 4096:
            raise IntegrityError(f"{what}: memory size must be a positive multiple of 4096")
        if self.disk_size is not None:
            _integer(self.disk_size, "disk_size", what, 0, MAX_IMAGE_SIZE)
        _integer(self.schema, "schema", what, CONFIG_SCHEMA, CONFIG_SCHEMA)
        for label, doc in (("recipe", self.recipe), ("extra", self.extra)):
            if doc is not None and not isinstance(doc, dict):
                raise IntegrityError(f"{what}: {label} must be an object")
        if self.compat is not None:
            c = self.compat
            _integer(c.vcpus, "compat.vcpus", what, 1, MAX_VCPUS)
            _integer(c.memory_mib, "compat.memory_mib", what, 1, MAX_MEMORY_MIB)
            _integer(c.agent_protocol, "compat.agent_protocol", what, 0, MAX_PROTOCOL)
            if not isinstance(c.accelerators, list) or not c.accelerators:
                raise IntegrityError(f"{what}: compat.accelerators must be a non-empty list")
            if c.kernel_digest is not None:
                try:
                    dg.validate(_text(c.kernel_digest, "compat.kernel_digest", what))
                except InvalidInput as exc:
                    raise IntegrityError(f"{what}: compat.kernel_digest: {exc}") from None
        if self.compacted_from is not None:
            _integer(self.compacted_from.from_depth, "compacted_from.from_depth", what, 0,
                     MAX_DEPTH)
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


def _text(value: object, label: str, what: str) -> str:
    if not isinstance(value, str):
        raise IntegrityError(f"{what}: {label} must be text, not {type(value).__name__}")
    return value


def _integer(value: object, label: str, what: str, low: int, high: int) -> int:
    """``value`` when it is an int (a bool is not) in [low, high], else IntegrityError
    (the value itself is not quoted: it may be a text meant for a terminal)."""
    if not jsondoc.is_integer(value):
        raise IntegrityError(f"{what}: {label} must be an integer, not "
                             f"{type(value).__name__}; the pack is malformed")
    if not low <= value <= high:
        raise IntegrityError(f"{what}: {label} is {value}, outside [{low}, {high}]; the "
                             "pack is malformed")
    return value
