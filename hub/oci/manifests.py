"""Manifests: ``GET``/``HEAD``/``PUT``/``DELETE /v2/<name>/manifests/<tag-or-digest>``.

A pushed manifest must be a JSON OCI image manifest or index (or their Docker v2
equivalents), at most ``manifest_max_bytes`` (413 beyond), nested at most
``forkd.jsondoc.MAX_DEPTH`` deep, unambiguous (its ``mediaType`` agreeing with
``Content-Type``, no fields of the other kind: CVE-2021-41190), every descriptor well
formed, and every blob or child manifest it references already in the repository,
whatever the layer's media type (non-distributable layers and ``urls`` included).
Its bytes are a blob in the shared store; the ``manifests`` row records media type,
artifact type and subject for the referrers API.

References are checked set-based, one query per ``IN_CHUNK`` digests. A manifest with
more than ``IN_CHUNK`` is checked before the write lock (a refusal never takes it) and
the write transaction confirms the check with a count per chunk; a smaller one is
checked in one query under the lock. The write transaction stores the bytes and records
the manifest with its references in one batch, so a manifest of 30,000 layers holds the
lock for about 70 statements, not 60,000. A lock timeout is 503 with ``Retry-After``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
from litestar import Response
from sqlalchemy import bindparam, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd import digest as dg
from forkd import jsondoc
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.hub import quotas
from forkd.hub.accounts import Principal
from forkd.hub.authz import access
from forkd.hub.db import Database
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Blob, Manifest, ManifestReference, Repository, Tag, utcnow
from forkd.hub.oci.common import (
    IN_CHUNK,
    Ctx,
    count_linked_blobs,
    database_contention,
    declared_length,
    in_chunks,
    linked_blob_sizes,
    parse_digest,
)
from forkd.hub.services import Hub
from forkd.names import shown, validate_tag, whole
from forkd.pack import mediatypes as mt
from forkd.pack.imagemap import check_descriptor_sizes

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
IMAGE_TYPES = frozenset({mt.OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({mt.OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = IMAGE_TYPES | INDEX_TYPES
# Docker's schema 2 manifest and manifest list require their ``mediaType`` field; the OCI
# image-spec only recommends it (SHOULD).
MEDIA_TYPE_REQUIRED = frozenset({DOCKER_MANIFEST, DOCKER_LIST})
IMAGE_FIELDS = ("config", "layers")
INDEX_FIELDS = ("manifests",)
DEPENDENTS_NAMED = 5  # snapshots a refused DELETE names


def _invalid(detail: str) -> RegistryError:
    return RegistryError(Code.MANIFEST_INVALID, detail)


# A media type (RFC 6838 ``type/subtype``, restricted-name characters, then parameters of
# printable ASCII), as the image-spec requires of ``mediaType`` and ``artifactType``.
MEDIA_TYPE_RE = whole(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
    r"(?: *;[ -~]*)?"
)


def _media_type(value: object, where: str) -> str:
    """``value`` if it is a media type of at most 255 characters, else MANIFEST_INVALID:
    these are shown in listings (the referrers index, the catalog API, ``oras discover``
    in a terminal) and stored, and free text there carried escape sequences and line
    breaks of the pusher's to every reader."""
    if not isinstance(value, str) or len(value) > 255 or not MEDIA_TYPE_RE.match(value):
        raise _invalid(
            f"{where} must be a media type (RFC 6838 type/subtype, printable ASCII, at most "
            f"255 characters), not {shown(value)}"
        )
    return value


def _descriptor(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be a descriptor object")
    media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    _media_type(media_type, f"{where}.mediaType")
    if not isinstance(digest, str):
        raise _invalid(f"{where}.digest must be a string")
    try:
        dg.validate_oci(digest)  # sha256 or sha512 (image-spec descriptor.md, "Digests")
    except InvalidInput as exc:
        raise _invalid(f"{where}.digest: {exc}") from exc
    if not jsondoc.is_integer(size, 0):
        raise _invalid(f"{where}.size must be a non-negative integer")
    urls = value.get("urls")
    if urls is not None and (
        not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)
    ):
        raise _invalid(f"{where}.urls must be a list of strings")
    return value


def _check_kind(doc: dict[str, Any], content_type: str) -> None:
    """One document, one reading (CVE-2021-41190): the ``mediaType`` field, when present,
    is the Content-Type; an image manifest carries no ``manifests`` and an index no
    ``config`` or ``layers``, so no client can take the bytes for the other kind."""
    if "mediaType" in doc:
        if doc["mediaType"] != content_type:
            raise _invalid(
                f"mediaType {str(doc['mediaType'])[:100]!r} differs from Content-Type "
                f"{shown(content_type)}: send the document's own media type"
            )
    elif content_type in MEDIA_TYPE_REQUIRED:
        raise _invalid(f"a {content_type} document must carry its mediaType field")
    is_index = content_type in INDEX_TYPES
    foreign = [key for key in (IMAGE_FIELDS if is_index else INDEX_FIELDS) if key in doc]
    if foreign:
        kind, other = ("an index", "image manifest") if is_index else ("an image manifest", "index")
        raise _invalid(
            f"{kind} must not carry {', '.join(foreign)} (fields of an {other}): the "
            "document would be ambiguous"
        )


def _check_subject_not_child(doc: dict[str, Any]) -> None:
    """An index's ``subject`` is not one of its own ``manifests``: a manifest is either a
    child the index needs or the subject it refers to, never both (the deletion check of
    a child, ``_refuse_index_child``, does not count indexes that merely name it as
    their subject, so such an index let its child be deleted under it)."""
    subject = doc["subject"]["digest"]
    if any(child["digest"] == subject for child in doc.get("manifests", [])):
        raise _invalid(
            f"subject {shown(subject)} is also one of this index's manifests: an index "
            "cannot refer to its own child; drop the subject or push the referrer as a "
            "separate manifest"
        )


def parse_manifest(body: bytes, content_type: str) -> dict[str, Any]:
    """Check a manifest's structure against its media type; return the parsed document."""
    if content_type not in MANIFEST_TYPES:
        raise _invalid(
            f"unsupported manifest media type {content_type[:100]!r}: use one of "
            + ", ".join(sorted(MANIFEST_TYPES))
        )
    try:
        doc = jsondoc.loads(body, "manifest")
    except InvalidInput as exc:
        raise _invalid(str(exc)) from exc
    if not isinstance(doc, dict):
        raise _invalid("manifest must be a JSON object")
    if doc.get("schemaVersion") != 2:
        raise _invalid("schemaVersion must be 2")
    _check_kind(doc, content_type)
    if content_type in IMAGE_TYPES:
        _descriptor(doc.get("config"), "config")
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise _invalid("layers must be a list")
        for i, layer in enumerate(layers):
            _descriptor(layer, f"layers[{i}]")
        try:  # pack-format bounds (issue 10 item 5): an oversized image map, before any read
            check_descriptor_sizes(doc)
        except IntegrityError as exc:
            raise _invalid(str(exc)) from exc
    else:
        children = doc.get("manifests")
        if not isinstance(children, list):
            raise _invalid("manifests must be a list")
        for i, child in enumerate(children):
            _descriptor(child, f"manifests[{i}]")
    if "subject" in doc:
        _descriptor(doc["subject"], "subject")
        _check_subject_not_child(doc)
    if doc.get("artifactType") is not None:
        _media_type(doc["artifactType"], "artifactType")
    annotations = doc.get("annotations")
    if annotations is not None and (
        not isinstance(annotations, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items())
    ):
        raise _invalid("annotations must map strings to strings")
    return doc


def checked_manifest(body: bytes, content_type: str, algorithm: str) -> PushedManifest:
    """``body`` parsed and checked (``parse_manifest``) and hashed with ``algorithm``."""
    return PushedManifest(
        body, content_type, parse_manifest(body, content_type), dg.of_bytes(body, algorithm)
    )


@dataclass(frozen=True)
class PushedManifest:
    """A manifest as pushed: its bytes, media type (the Content-Type), the document as
    ``parse_manifest`` checked it, and its digest."""

    body: bytes
    media_type: str
    doc: dict[str, Any]
    digest: str

    @property
    def blobs(self) -> list[dict[str, Any]]:
        """The blob descriptors that must be in the repository: config and every layer."""
        if self.media_type in IMAGE_TYPES:
            return [self.doc["config"], *self.doc["layers"]]
        return []

    @property
    def children(self) -> list[dict[str, Any]]:
        """The manifest descriptors that must be in the repository (an index's)."""
        return list(self.doc["manifests"]) if self.media_type in INDEX_TYPES else []

    @property
    def subject(self) -> str | None:
        subject = self.doc.get("subject")
        return str(subject["digest"]) if subject else None

    @property
    def artifact_type(self) -> str | None:
        """``artifactType``, else an image manifest's config media type (referrers API)."""
        artifact_type = self.doc.get("artifactType")
        if artifact_type is None and self.media_type in IMAGE_TYPES:
            return str(self.doc["config"]["mediaType"])
        return artifact_type

    @property
    def required(self) -> set[str]:
        """The digests that must be in the repository: blobs and child manifests."""
        return {d["digest"] for d in [*self.blobs, *self.children]}

    def references(self) -> set[str]:
        """Digests this manifest keeps alive (GC roots): config, layers, children, subject."""
        refs = self.required
        if self.subject:
            refs.add(self.subject)
        return refs


async def _read_body(ctx: Ctx) -> bytes:
    limit = ctx.hub.settings.manifest_max_bytes
    too_big = RegistryError(
        Code.SIZE_INVALID, f"manifest is larger than the limit of {limit} bytes", status=413
    )
    declared = declared_length(ctx.request)
    if declared is not None and declared > limit:
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


def _check_reference(reference: str) -> None:
    """A manifest reference is a digest (else 400 DIGEST_INVALID) or a tag (else 400
    MANIFEST_INVALID), on every method: a malformed one names nothing that could exist,
    so it is the client's error, not an unknown manifest (404)."""
    if _is_digest(reference):
        parse_digest(reference)
        return
    try:
        validate_tag(reference)
    except InvalidInput as exc:
        raise RegistryError(Code.MANIFEST_INVALID, str(exc)) from exc


async def put(ctx: Ctx, reference: str) -> Response[object]:
    await ctx.allow("push")
    _check_reference(reference)
    body = await _read_body(ctx)
    content_type = ctx.request.headers.get("content-type", "").split(";", 1)[0].strip()
    # Pushed by digest: verified, stored and known by that digest's algorithm (sha256 or
    # sha512), so Docker-Content-Digest matches the client's; pushed by tag: sha256.
    algorithm = dg.algorithm_of(reference) if _is_digest(reference) else dg.ALGORITHM
    if len(body) <= jsondoc.INLINE_MAX:
        pushed = checked_manifest(body, content_type, algorithm)
    else:  # seconds of pure-Python work for 4 MiB of small objects: off the event loop
        pushed = await anyio.to_thread.run_sync(checked_manifest, body, content_type, algorithm)
    digest = pushed.digest
    if _is_digest(reference) and reference != digest:
        raise RegistryError(Code.DIGEST_INVALID, f"body digest is {digest}, not {reference}")
    hub = ctx.hub
    tag = None if _is_digest(reference) else reference
    # A big manifest's references are checked before the write lock, so a refusal never
    # takes it and the lock covers a count per chunk; a small one's (one query) under it.
    prechecked = len(pushed.required) > IN_CHUNK
    with database_contention():
        checked = ctx.checked  # as read by allow; None: not created yet
        if prechecked:
            async with hub.db.reading() as session:
                await session.run_sync(
                    check_references, checked.id if checked else None, ctx.name, pushed
                )
        # One write transaction confirms the references, stores the bytes and records the
        # manifest, so a blob cannot be unlinked or swept between the confirmation and the
        # insert, and a refused manifest leaves nothing behind.
        async with hub.db.transaction() as session:
            await hub.db.lock_for_write(session)
            await ctx.still_async(session, "push")  # the body may have been slow to come
            repo = await ctx.repository_for_push(session)
            await _register(hub, session, repo, pushed, tag, prechecked=prechecked)
    ctx.audit("manifest.push", reference, digest=digest)
    headers = {"Location": ctx.url(f"manifests/{digest}"), "Docker-Content-Digest": digest}
    if pushed.subject:
        headers["OCI-Subject"] = pushed.subject
    if tag is not None:
        for hook in hub.after_push:  # e.g. the retention rule's compaction (hub/compaction.py)
            hook(ctx.name, tag, digest, pushed.doc)
    return Response(b"", status_code=201, headers=headers)


def _manifest_sizes(session: Session, repo_id: int, digests: set[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    for chunk in in_chunks(digests):
        rows = session.execute(
            select(Manifest.digest, Manifest.size).where(
                Manifest.repository_id == repo_id, Manifest.digest.in_(chunk)
            )
        )
        found.update({digest: size for digest, size in rows})
    return found


def _count_manifests(session: Session, repo_id: int, digests: set[str]) -> int:
    return sum(
        session.scalar(
            select(func.count())
            .select_from(Manifest)
            .where(Manifest.repository_id == repo_id, Manifest.digest.in_(chunk))
        )
        or 0
        for chunk in in_chunks(digests)
    )


def _check_found(
    descriptors: list[dict[str, Any]], found: dict[str, int], what: str, name: str
) -> None:
    """The first descriptor (in the manifest's order) that is missing or of another size."""
    for desc in descriptors:
        size = found.get(desc["digest"])
        if size is None:
            raise RegistryError(
                Code.MANIFEST_BLOB_UNKNOWN,
                f"{what} {desc['digest']} is not in {name}: push it before the manifest",
            )
        if size != desc["size"]:
            raise _invalid(f"{what} {desc['digest']} has size {size}, manifest says {desc['size']}")


def check_references(
    session: Session, repo_id: int | None, name: str, pushed: PushedManifest
) -> None:
    """Every config and layer blob linked into the repository, every child manifest in
    it, each with the declared size; MANIFEST_BLOB_UNKNOWN or MANIFEST_INVALID naming the
    first that is not. No media type (non-distributable layers included) and no ``urls``
    stand in for the content. Sync ORM code, one query per ``IN_CHUNK`` digests."""
    blobs = {d["digest"] for d in pushed.blobs}
    children = {d["digest"] for d in pushed.children}
    found_blobs = linked_blob_sizes(session, repo_id, blobs) if repo_id is not None else {}
    _check_found(pushed.blobs, found_blobs, "blob", name)
    found_children = _manifest_sizes(session, repo_id, children) if repo_id is not None else {}
    _check_found(pushed.children, found_children, "manifest", name)


def _references_present(session: Session, repo_id: int, pushed: PushedManifest) -> bool:
    """Whether everything ``check_references`` found is still there (a count per chunk)."""
    blobs = {d["digest"] for d in pushed.blobs}
    children = {d["digest"] for d in pushed.children}
    return count_linked_blobs(session, repo_id, blobs) == len(blobs) and _count_manifests(
        session, repo_id, children
    ) == len(children)


def check_tag_room(session: Session, repo_id: int, name: str, tag: str, most: int) -> None:
    """403 DENIED when ``tag`` is a new tag and ``name`` has ``most`` tags already (the
    ``tags_max`` setting): tags cost no quota, so they are bounded by count. Moving an
    existing tag is always allowed."""
    if session.get(Tag, (repo_id, tag)) is not None:
        return
    held = session.scalar(select(func.count()).select_from(Tag).where(Tag.repository_id == repo_id))
    if (held or 0) >= most:
        reason = (
            f"repository {shown(name)} has {held} tags, the limit is {most} (tags_max): "
            "move an existing tag, delete tags you no longer need, or ask the hub's operator"
        )
        raise RegistryError(Code.DENIED, reason, message=reason)


def check_manifest_room(session: Session, repo_id: int, name: str, digest: str, most: int) -> None:
    """403 DENIED when ``digest`` is a new manifest of the repository and it holds ``most``
    manifests already (the ``manifests_max`` setting): a manifest pushed by digest needs no
    tag, and without a quota it costs nothing, so manifests are bounded by count as tags
    are. Pushing a manifest the repository holds (to tag it, or again) is always allowed."""
    held_already = session.scalar(
        select(Manifest.id).where(Manifest.repository_id == repo_id, Manifest.digest == digest)
    )
    if held_already is not None:
        return
    held = session.scalar(
        select(func.count()).select_from(Manifest).where(Manifest.repository_id == repo_id)
    )
    if (held or 0) >= most:
        reason = (
            f"repository {shown(name)} has {held} manifests, the limit is {most} "
            "(manifests_max): delete manifests you no longer need (DELETE "
            f"/v2/{name}/manifests/DIGEST; untagged ones first), or ask the hub's operator"
        )
        raise RegistryError(Code.DENIED, reason, message=reason)


def record_manifest(
    session: Session, db: Database, repo_id: int, pushed: PushedManifest, tag: str | None
) -> None:
    """Insert a checked manifest's row and GC references and point ``tag`` at it; its
    bytes are in the store already. Sync ORM code, inside a write transaction."""
    quotas.charge(session, repo_id, pushed.digest, len(pushed.body))  # manifests count too
    annotations = pushed.doc.get("annotations")
    session.execute(db.insert_ignore(Blob).values(digest=pushed.digest, size=len(pushed.body)))
    session.execute(
        db.insert_ignore(Manifest).values(
            repository_id=repo_id,
            digest=pushed.digest,
            media_type=pushed.media_type,
            artifact_type=pushed.artifact_type,
            subject_digest=pushed.subject,
            annotations=json.dumps(annotations) if annotations else None,
            size=len(pushed.body),
            created_at=utcnow(),
        )
    )
    manifest_id = session.scalar(
        select(Manifest.id).where(
            Manifest.repository_id == repo_id, Manifest.digest == pushed.digest
        )
    )
    references = [
        {"manifest_id": manifest_id, "repository_id": repo_id, "digest": d}
        for d in sorted(pushed.references())
    ]
    if references:  # one executemany, not a statement per reference
        session.execute(db.insert_ignore(ManifestReference.__table__), references)
    if tag is not None:
        # One statement: a DELETE of the tag committing meanwhile (it takes no repository
        # lock) cannot make this update nothing (it inserts the tag again).
        session.execute(
            db.upsert(
                Tag,
                {
                    "repository_id": repo_id,
                    "name": tag,
                    "manifest_digest": pushed.digest,
                    "updated_at": utcnow(),
                },
                ["repository_id", "name"],
                ["manifest_digest", "updated_at"],
            )
        )
    session.execute(update(Repository).where(Repository.id == repo_id).values(updated_at=utcnow()))


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
    pushed = PushedManifest(body, content_type, doc, digest)
    await _register(hub, session, repo, pushed, tag, prechecked=False)


async def _register(
    hub: Hub,
    session: AsyncSession,
    repo: Repository,
    pushed: PushedManifest,
    tag: str | None,
    *,
    prechecked: bool,
) -> None:
    """``register_manifest``. ``prechecked``: ``check_references`` passed before the write
    lock was taken, so a count per chunk confirms it (the full check runs again only when
    a count is short, to name what went missing)."""
    # One writer of the repository's references at a time: a blob or child manifest
    # deletion checked before this push commits cannot take what it references.
    await hub.db.lock_repository(session, repo.id)
    # Under the lock: new manifests or tags racing for the last place take turns.
    await session.run_sync(
        check_manifest_room, repo.id, repo.name, pushed.digest, hub.settings.manifests_max
    )
    if tag is not None:
        await session.run_sync(check_tag_room, repo.id, repo.name, tag, hub.settings.tags_max)
    if not prechecked or not await session.run_sync(_references_present, repo.id, pushed):
        await session.run_sync(check_references, repo.id, repo.name, pushed)
    await anyio.to_thread.run_sync(hub.blobs.put_bytes, pushed.body, pushed.digest)
    await session.run_sync(record_manifest, hub.db, repo.id, pushed, tag)


_IN_REPOSITORY = select(Manifest).where(Manifest.repository_id == bindparam("repository_id"))
_BY_DIGEST = _IN_REPOSITORY.where(Manifest.digest == bindparam("reference"))
_BY_TAG = _IN_REPOSITORY.join(  # tag → manifest in one query (the hot path of every pull)
    Tag, (Tag.repository_id == Manifest.repository_id) & (Tag.manifest_digest == Manifest.digest)
).where(Tag.name == bindparam("reference"))


def find_manifest(session: Session, repository_id: int, reference: str) -> Manifest | None:
    """The repository's manifest with this digest, or that this tag points at."""
    query = _BY_DIGEST if _is_digest(reference) else _BY_TAG
    return session.scalars(query, {"repository_id": repository_id, "reference": reference}).first()


def _unknown(name: str, reference: str) -> RegistryError:
    return RegistryError(Code.MANIFEST_UNKNOWN, f"manifest {reference} not in {name}")


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
    _check_reference(reference)
    repo = ctx.known()
    if manifest is None:
        raise _unknown(ctx.name, reference)
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
    headers = {
        "Docker-Content-Digest": manifest.digest,
        "Content-Length": str(len(body)),
        "X-Content-Type-Options": "nosniff",
    }
    return Response(
        b"" if head else body,
        status_code=200,
        headers=headers,
        media_type=manifest.media_type,
    )


async def delete_manifest(ctx: Ctx, reference: str) -> Response[object]:
    """By tag: remove the tag. By digest: remove the manifest and every tag on it (202);
    manifests that name it as ``subject`` stay and list it as their subject still, except
    that a forkd snapshot other forkd snapshots build on is refused (405), and so is a
    manifest an index of the repository lists as a child (400), under the repository's
    lock (``Database.repository_lock``) so no such index is pushed meanwhile."""
    await ctx.allow("delete")
    _check_reference(reference)
    repo = ctx.known()
    with database_contention():
        await ctx.hub.db.write(_delete, ctx, repo.id, reference)
    ctx.audit("manifest.delete", reference)
    return Response(b"", status_code=202)


def _delete(session: Session, ctx: Ctx, repo_id: int, reference: str) -> None:
    db, name = ctx.hub.db, ctx.name
    db.write_lock(session)
    if not _is_digest(reference):
        ctx.still(session, "delete")
        # One statement, whose row count says whether the tag was there: a push or a
        # deletion of it committing meanwhile cannot make this delete nothing unseen.
        gone = session.execute(
            delete(Tag).where(Tag.repository_id == repo_id, Tag.name == reference)
        )
        if not getattr(gone, "rowcount", 0):
            raise RegistryError(Code.MANIFEST_UNKNOWN, f"tag {reference} not in {name}")
        return
    # No push of an index naming this manifest can commit between the check and the delete.
    db.write_lock(session)
    db.repository_lock(session, repo_id)
    quotas.lock_namespace(session, repo_id)
    ctx.still(session, "delete")
    manifest = find_manifest(session, repo_id, parse_digest(reference))
    if manifest is None:
        raise _unknown(name, reference)
    _refuse_snapshot_base(session, manifest, name)
    _refuse_index_child(session, manifest, name)
    session.execute(
        delete(Tag).where(Tag.repository_id == repo_id, Tag.manifest_digest == reference)
    )
    session.delete(manifest)
    session.flush()
    quotas.release(session, repo_id, reference)


def _refuse_snapshot_base(session: Session, manifest: Manifest, name: str) -> None:
    """A forkd snapshot is a diff on its subject: deleting a snapshot that other forkd
    snapshots of the repository build on would leave chains no one can restore. The
    spec's answer for a deletion the registry does not allow is 405."""
    if manifest.artifact_type != mt.ARTIFACT_TYPE:
        return
    dependents = (
        select(Manifest.digest)
        .where(
            Manifest.repository_id == manifest.repository_id,
            Manifest.subject_digest == manifest.digest,
            Manifest.artifact_type == mt.ARTIFACT_TYPE,
        )
        .order_by(Manifest.created_at, Manifest.digest)
    )
    named = list(session.scalars(dependents.limit(DEPENDENTS_NAMED)))
    if not named:
        return
    total = session.scalar(select(func.count()).select_from(dependents.subquery())) or 0
    more = f" and {total - len(named)} more" if total > len(named) else ""
    raise RegistryError(
        Code.UNSUPPORTED,
        f"{total} forkd snapshot(s) in {name} build on {manifest.digest}: "
        f"{', '.join(named)}{more}. Delete those first (children before parents), or "
        "flatten the chain (forkd compact --remote) so nothing depends on this one",
        status=405,
        headers={"Allow": "GET, HEAD, PUT"},
    )


def referencing(
    session: Session, repo_id: int, digest: str, *, children_of: Manifest | None = None
) -> tuple[list[str], int]:
    """The manifests of the repository that reference ``digest`` (up to
    ``DEPENDENTS_NAMED`` of them, oldest first) and how many there are. With
    ``children_of`` (the manifest of that digest): only indexes listing it as a child, not
    manifests naming it as their ``subject`` (referrers may outlive their subject)."""
    query = (
        select(Manifest.digest)
        .join(ManifestReference, ManifestReference.manifest_id == Manifest.id)
        .where(
            ManifestReference.repository_id == repo_id,  # by the repository's own rows
            ManifestReference.digest == digest,
            Manifest.repository_id == repo_id,
        )
    )
    if children_of is not None:
        query = query.where(
            Manifest.id != children_of.id,
            Manifest.media_type.in_(INDEX_TYPES),
            or_(Manifest.subject_digest.is_(None), Manifest.subject_digest != digest),
        )
    query = query.order_by(Manifest.created_at, Manifest.digest)
    named = list(session.scalars(query.limit(DEPENDENTS_NAMED)))
    if not named:
        return [], 0
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    return named, total


def still_referenced(what: str, named: list[str], total: int, name: str) -> RegistryError:
    """The refusal of a deletion that would leave manifests of the repository without
    what they reference: 400 (the spec's answer for a deletion the registry does not
    allow is 400 or 405), naming up to ``DEPENDENTS_NAMED`` of them and saying what to do."""
    more = f" and {total - len(named)} more" if total > len(named) else ""
    return RegistryError(
        Code.UNSUPPORTED,
        f"{what} is referenced by {total} manifest(s) of {name}: {', '.join(named)}{more}. "
        "Delete those manifests first (DELETE /v2/NAME/manifests/DIGEST), then this one",
        status=400,
    )


def _refuse_index_child(session: Session, manifest: Manifest, name: str) -> None:
    """An index of the repository lists this manifest: deleting it would leave the index
    pointing at nothing (and give its bytes back to the quota while the index's pulls
    still need them)."""
    named, total = referencing(
        session, manifest.repository_id, manifest.digest, children_of=manifest
    )
    if named:
        raise still_referenced(f"manifest {manifest.digest}", named, total, name)
