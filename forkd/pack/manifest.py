"""OCI image manifests of pack layers: building them and validating untrusted ones."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError
from forkd.pack import mediatypes as mt
from forkd.pack.config import MAX_CONFIG_BYTES
from forkd.pack.imagemap import ImageMap

MAX_MANIFEST_BYTES = 4 << 20
SCHEMA_VERSION = 2
_CHUNK_TYPES = {chunk for _, chunk in mt.IMAGE_ROLES.values()}
_MAP_ROLES = {m: role for role, (m, _) in mt.IMAGE_ROLES.items()}
_FILE_ROLES = {m: role for role, m in mt.FILE_ROLES.items()}


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.annotations:
            doc["annotations"] = dict(self.annotations)
        return doc

    @classmethod
    def from_json(cls, raw: Any, what: str) -> Descriptor:
        if not isinstance(raw, dict):
            raise IntegrityError(f"{what}: descriptor must be an object")
        media_type, size = raw.get("mediaType"), raw.get("size")
        if not isinstance(media_type, str) or not isinstance(size, int) or size < 0:
            raise IntegrityError(f"{what}: descriptor needs a mediaType and a non-negative size")
        annotations = raw.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise IntegrityError(f"{what}: annotations must map strings to strings")
        return cls(media_type, dg.validate(raw.get("digest", "")), size, annotations)


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated pack-layer manifest."""

    config: Descriptor
    maps: dict[str, Descriptor]  # role ("memory", "disk") -> map descriptor
    chunks: tuple[Descriptor, ...]
    files: dict[str, Descriptor]  # role ("vmstate", "kernel", "initrd") -> blob
    subject: Descriptor | None
    annotations: dict[str, str]

    @property
    def parent_tag(self) -> str | None:
        return self.annotations.get(mt.ANNOTATION_PARENT_TAG)

    def blobs(self) -> list[Descriptor]:
        """Every blob this manifest references (config, maps, chunks, files), unique."""
        seen: dict[str, Descriptor] = {}
        for d in [self.config, *self.maps.values(), *self.chunks, *self.files.values()]:
            seen.setdefault(d.digest, d)
        return list(seen.values())

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "schemaVersion": SCHEMA_VERSION,
            "mediaType": mt.OCI_MANIFEST,
            "artifactType": mt.ARTIFACT_TYPE,
            "config": self.config.to_json(),
            "layers": [d.to_json() for d in self._layers()],
        }
        if self.subject is not None:
            doc["subject"] = self.subject.to_json()
        if self.annotations:
            doc["annotations"] = dict(sorted(self.annotations.items()))
        return json.dumps(doc, indent=2).encode()

    def _layers(self) -> list[Descriptor]:
        out: list[Descriptor] = []
        for role in mt.IMAGE_ROLES:
            if role in self.maps:
                out.append(self.maps[role])
        out.extend(self.chunks)
        out.extend(self.files[r] for r in mt.FILE_ROLES if r in self.files)
        return out

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "manifest") -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise IntegrityError(
                f"{what} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
            )
        raw = jsondoc.loads(data, what)
        if not isinstance(raw, dict) or raw.get("schemaVersion") != SCHEMA_VERSION:
            raise IntegrityError(f"{what}: not an OCI manifest with schemaVersion 2")
        if raw.get("mediaType") != mt.OCI_MANIFEST or raw.get("artifactType") != mt.ARTIFACT_TYPE:
            raise IntegrityError(
                f"{what}: not a forkd snapshot (mediaType {raw.get('mediaType')!r}, "
                f"artifactType {raw.get('artifactType')!r})"
            )
        config = Descriptor.from_json(raw.get("config"), f"{what} config")
        if config.media_type != mt.CONFIG:
            raise IntegrityError(
                f"{what}: config media type {config.media_type!r} is not {mt.CONFIG}"
            )
        if config.size > MAX_CONFIG_BYTES:  # refused before a byte of it is fetched
            raise IntegrityError(
                f"{what}: config is {config.size} bytes, over the {MAX_CONFIG_BYTES}-byte limit"
            )
        layers = raw.get("layers")
        if not isinstance(layers, list):
            raise IntegrityError(f"{what}: layers must be a list")
        maps: dict[str, Descriptor] = {}
        files: dict[str, Descriptor] = {}
        chunks: list[Descriptor] = []
        for i, item in enumerate(layers):
            d = Descriptor.from_json(item, f"{what} layer {i}")
            if d.media_type in _MAP_ROLES:
                _put_once(maps, _MAP_ROLES[d.media_type], d, what)
            elif d.media_type in _FILE_ROLES:
                _put_once(files, _FILE_ROLES[d.media_type], d, what)
            elif d.media_type in _CHUNK_TYPES:
                chunks.append(d)
            else:
                raise IntegrityError(f"{what}: unknown layer media type {d.media_type!r}")
        if "memory" not in maps:
            raise IntegrityError(f"{what}: has no memory map layer")
        subject = None
        if raw.get("subject") is not None:
            subject = Descriptor.from_json(raw["subject"], f"{what} subject")
            if subject.media_type != mt.OCI_MANIFEST:
                raise IntegrityError(f"{what}: subject must be an OCI image manifest")
        annotations = raw.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise IntegrityError(f"{what}: annotations must map strings to strings")
        return cls(config, maps, tuple(chunks), files, subject, annotations)

    def check_map(self, role: str, imap: ImageMap, what: str) -> None:
        """Every chunk the map names must be among this manifest's chunk descriptors."""
        chunk_type = mt.IMAGE_ROLES[role][1]
        listed = {d.digest: d.size for d in self.chunks if d.media_type == chunk_type}
        for c in imap.chunks:
            if listed.get(c.digest) != c.stored:
                raise IntegrityError(
                    f"{what}: {role} chunk {c.digest} is not listed in the manifest with "
                    f"size {c.stored}"
                )


def _put_once(into: dict[str, Descriptor], role: str, d: Descriptor, what: str) -> None:
    if role in into:
        raise IntegrityError(f"{what}: more than one {role} layer")
    into[role] = d
