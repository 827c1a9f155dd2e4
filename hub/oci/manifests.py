"""Manifests: ``GET``/``HEAD``/``PUT``/``DELETE /v2/<name>/manifests/<tag-or-digest>``.

A pushed manifest must be a JSON OCI image manifest or index (or their Docker v2
equivalents), at most ``manifest_max_bytes`` (413 beyond), its ``mediaType``
agreeing with ``Content-Type``, every descriptor well formed, and every blob or
child manifest it references already in the repository. Its bytes are a blob in
the shared store; the ``manifests`` row records media type, artifact type and
subject for the referrers API.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from litestar import Response
from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd import digest as dg
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.hub.accounts import Principal, access
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Manifest, ManifestReference, Repository, Tag, utcnow
from forkd.hub.oci.common import Ctx, linked_blob_size, parse_digest
from forkd.hub.services import Hub
from forkd.names import validate_tag
from forkd.pack import mediatypes as mt

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
IMAGE_TYPES = frozenset({mt.OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({mt.OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = IMAGE_TYPES | INDEX_TYPES


def _invalid(detail: str) -> RegistryError:
    return RegistryError(Code.MANIFEST_INVALID, detail)


def _descriptor(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be a descriptor object")
    media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if not isinstance(media_type, str) or not media_type or len(media_type) > 255:
        raise _invalid(f"{where}.mediaType must be a non-empty string")
    if not isinstance(digest, str):
        raise _invalid(f"{where}.digest must be a string")
    try:
        dg.validate(digest)
    except InvalidInput as exc:
        raise _invalid(f"{where}.digest: {exc}") from exc
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _invalid(f"{where}.size must be a non-negative integer")
    return value


def _optional_str(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > 255):
        raise _invalid(f"{key} must be a string of at most 255 characters")
    return value


def parse_manifest(body: bytes, content_type: str) -> dict[str, Any]:
    """Check a manifest's structure against its media type; return the parsed document."""
    if content_type not in MANIFEST_TYPES:
        raise _invalid(
            f"unsupported manifest media type {content_type[:100]!r}: use one of "
            + ", ".join(sorted(MANIFEST_TYPES))
        )
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _invalid(f"manifest is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise _invalid("manifest must be a JSON object")
    if doc.get("schemaVersion") != 2:
        raise _invalid("schemaVersion must be 2")
    if "mediaType" in doc and doc["mediaType"] != content_type:
        raise _invalid(f"mediaType {doc['mediaType']!r} differs from Content-Type {content_type!r}")
    if content_type in IMAGE_TYPES:
        _descriptor(doc.get("config"), "config")
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise _invalid("layers must be a list")
        for i, layer in enumerate(layers):
            _descriptor(layer, f"layers[{i}]")
    else:
        children = doc.get("manifests")
        if not isinstance(children, list):
            raise _invalid("manifests must be a list")
        for i, child in enumerate(children):
            _descriptor(child, f"manifests[{i}]")
    if "subject" in doc:
        _descriptor(doc["subject"], "subject")
    _optional_str(doc, "artifactType")
    annotations = doc.get("annotations")
    if annotations is not None and (
        not isinstance(annotations, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items())
    ):
        raise _invalid("annotations must map strings to strings")
    return doc


async def _read_body(ctx: Ctx) -> bytes:
    limit = ctx.hub.settings.manifest_max_bytes
    too_big = RegistryError(
        Code.SIZE_INVALID, f"manifest is larger than the limit of {limit} bytes", status=413
    )
    declared = ctx.request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    parts: list[bytes] = []
    total = 0
    async for chunk in ctx.request.stream():
        total += len(chunk)
        if total > limit:
            raise too_big
        parts.append(chunk)
    return b"".join(parts)


def _is_digest(reference: str) -> bool:
    return ":" in reference


def _check_reference(reference: str, code: Code) -> None:
    try:
        if _is_digest(reference):
            dg.validate(reference)
        else:
            validate_tag(reference)
    except InvalidInput as exc:
        raise RegistryError(code, str(exc)) from exc


async def put(ctx: Ctx, reference: str) -> Response[object]:
    await ctx.allow("push")
    _check_reference(reference, Code.MANIFEST_INVALID)
    body = await _read_body(ctx)
    content_type = ctx.request.headers.get("content-type", "").split(";", 1)[0].strip()
    doc = parse_manifest(body, content_type)
    digest = dg.of_bytes(body)
    if _is_digest(reference) and reference != digest:
        raise RegistryError(Code.DIGEST_INVALID, f"body digest is {digest}, not {reference}")
    hub = ctx.hub
    # One transaction checks the references, stores the bytes and records the manifest, so
    # a blob cannot be unlinked between the check and the insert, and a refused manifest
    # leaves nothing behind.
    async with hub.db.transaction() as session:
        await hub.db.lock_for_write(session)
        repo = await ctx.repository_for_push(session)
        tag = None if _is_digest(reference) else reference
        await register_manifest(hub, session, repo, body, content_type, doc, digest, tag)
    ctx.audit("manifest.push", reference, digest=digest)
    headers = {"Location": ctx.url(f"manifests/{digest}"), "Docker-Content-Digest": digest}
    subject = doc.get("subject")
    if subject:
        headers["OCI-Subject"] = subject["digest"]
    if not _is_digest(reference):
        for hook in hub.after_push:  # e.g. the retention rule's compaction (hub/compaction.py)
            hook(ctx.name, reference, digest, doc)
    return Response(b"", status_code=201, headers=headers)


async def register_manifest(
    hub: Hub,
    session: AsyncSession,
    repo: Repository,
    body: bytes,
    content_type: str,
    doc: dict[str, Any],
    digest: str,
    tag: str | None,
) -> None:
    """Record a checked manifest (``parse_manifest``) in ``repo`` and point ``tag`` at it:
    check its references, store its bytes, insert its row and GC references, set the tag.

    The caller holds a transaction with ``lock_for_write``. A manifest ``PUT`` and the
    server-side compaction (hub/compaction.py) both register manifests through here.
    """
    subject = doc.get("subject")
    artifact_type = doc.get("artifactType")
    if artifact_type is None and content_type in IMAGE_TYPES:
        artifact_type = doc["config"]["mediaType"]
    annotations = doc.get("annotations")
    await _check_references(session, repo, doc, content_type)
    await anyio.to_thread.run_sync(hub.blobs.put_bytes, body, digest)
    await session.execute(hub.db.insert_ignore(Blob).values(digest=digest, size=len(body)))
    await session.execute(
        hub.db.insert_ignore(Manifest).values(
            repository_id=repo.id,
            digest=digest,
            media_type=content_type,
            artifact_type=artifact_type,
            subject_digest=subject["digest"] if subject else None,
            annotations=json.dumps(annotations) if annotations else None,
            size=len(body),
            created_at=utcnow(),
        )
    )
    manifest_id = await session.scalar(
        select(Manifest.id).where(Manifest.repository_id == repo.id, Manifest.digest == digest)
    )
    for ref in _referenced(doc, content_type):
        await session.execute(
            hub.db.insert_ignore(ManifestReference).values(manifest_id=manifest_id, digest=ref)
        )
    if tag is not None:
        row = await session.get(Tag, (repo.id, tag))
        if row is None:
            session.add(Tag(repository_id=repo.id, name=tag, manifest_digest=digest))
        else:
            row.manifest_digest = digest
            row.updated_at = utcnow()
    await session.execute(
        update(Repository).where(Repository.id == repo.id).values(updated_at=utcnow())
    )


def _referenced(doc: dict[str, Any], content_type: str) -> set[str]:
    """Digests this manifest keeps alive (GC roots): config, layers, children, subject."""
    if content_type in IMAGE_TYPES:
        descriptors = [doc["config"], *doc["layers"]]
    else:
        descriptors = list(doc["manifests"])
    if doc.get("subject"):
        descriptors.append(doc["subject"])
    return {d["digest"] for d in descriptors}


async def _check_references(
    session: Any, repo: Repository, doc: dict[str, Any], content_type: str
) -> None:
    if content_type in IMAGE_TYPES:
        for desc in [doc["config"], *doc["layers"]]:
            size = await linked_blob_size(session, repo.id, desc["digest"])
            if size is None:
                raise RegistryError(
                    Code.MANIFEST_BLOB_UNKNOWN, f"blob {desc['digest']} is not in {repo.name}"
                )
            if size != desc["size"]:
                raise _invalid(
                    f"blob {desc['digest']} has size {size}, manifest says {desc['size']}"
                )
    else:
        for desc in doc["manifests"]:
            found = await session.scalar(
                select(Manifest.size).where(
                    Manifest.repository_id == repo.id, Manifest.digest == desc["digest"]
                )
            )
            if found is None:
                raise RegistryError(
                    Code.MANIFEST_BLOB_UNKNOWN, f"manifest {desc['digest']} is not in {repo.name}"
                )


_IN_REPOSITORY = select(Manifest).where(Manifest.repository_id == bindparam("repository_id"))
_BY_DIGEST = _IN_REPOSITORY.where(Manifest.digest == bindparam("reference"))
_BY_TAG = _IN_REPOSITORY.join(  # tag → manifest in one query (the hot path of every pull)
    Tag, (Tag.repository_id == Manifest.repository_id) & (Tag.manifest_digest == Manifest.digest)
).where(Tag.name == bindparam("reference"))


def find_manifest(session: Session, repository_id: int, reference: str) -> Manifest | None:
    """The repository's manifest with this digest, or that this tag points at."""
    query = _BY_DIGEST if _is_digest(reference) else _BY_TAG
    return session.scalars(query, {"repository_id": repository_id, "reference": reference}).first()


def _unknown(ctx: Ctx, reference: str) -> RegistryError:
    return RegistryError(Code.MANIFEST_UNKNOWN, f"manifest {reference} not in {ctx.name}")


def _pull_lookup(
    session: Session, principal: Principal, name: str, reference: str
) -> tuple[Repository | None, frozenset[str], Manifest | None]:
    """The access check's reads and the manifest, in one read transaction. The manifest
    is only looked up for a caller who may pull, and only used after ``Ctx.permit``."""
    repo, held = access(session, principal, name)
    if repo is None or "pull" not in held:
        return repo, held, None
    return repo, held, find_manifest(session, repo.id, reference)


async def get(ctx: Ctx, reference: str, *, head: bool) -> Response[object]:
    hub = ctx.hub
    repo, held, manifest = await hub.db.read(
        _pull_lookup, ctx.caller.principal, ctx.name, reference
    )
    ctx.permit("pull", repo, held)
    _check_reference(reference, Code.MANIFEST_UNKNOWN)
    repo = ctx.known()
    if manifest is None:
        raise _unknown(ctx, reference)
    if not head:
        hub.pulls.record(repo.id, None if _is_digest(reference) else reference)
    body = hub.manifests.get(manifest.digest)
    if body is None:
        try:
            body = await anyio.to_thread.run_sync(  # off the event loop: S3 is a network read
                hub.blobs.read, manifest.digest, hub.settings.manifest_max_bytes, "manifest"
            )
        except (NotFound, IntegrityError, InvalidInput) as exc:
            raise RegistryError(Code.MANIFEST_UNKNOWN, str(exc)) from exc
        hub.manifests.put(manifest.digest, body)
    headers = {"Docker-Content-Digest": manifest.digest, "Content-Length": str(len(body))}
    return Response(
        b"" if head else body,
        status_code=200,
        headers=headers,
        media_type=manifest.media_type,
    )


async def delete_manifest(ctx: Ctx, reference: str) -> Response[object]:
    """By tag: remove the tag. By digest: remove the manifest and every tag on it, unless
    other manifests in the repository name it as subject (409: a chain depends on it)."""
    await ctx.allow("delete")
    _check_reference(reference, Code.MANIFEST_UNKNOWN)
    async with ctx.hub.db.transaction() as session:
        repo = await ctx.repository(session)
        if not _is_digest(reference):
            tag = await session.get(Tag, (repo.id, reference))
            if tag is None:
                raise RegistryError(Code.MANIFEST_UNKNOWN, f"tag {reference} not in {ctx.name}")
            await session.delete(tag)
        else:
            manifest = await session.run_sync(find_manifest, repo.id, parse_digest(reference))
            if manifest is None:
                raise _unknown(ctx, reference)
            children = await session.scalar(
                select(func.count()).where(
                    Manifest.repository_id == repo.id, Manifest.subject_digest == reference
                )
            )
            if children:
                raise RegistryError(
                    Code.DENIED,
                    f"{children} manifest(s) in {ctx.name} name {reference} as subject (a chain "
                    "depends on it); delete them first",
                    status=409,
                )
            await session.execute(
                delete(Tag).where(Tag.repository_id == repo.id, Tag.manifest_digest == reference)
            )
            await session.delete(manifest)
    ctx.audit("manifest.delete", reference)
    return Response(b"", status_code=202)
