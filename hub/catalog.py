"""Hub API ``/api/v1``: search, list and describe the repositories a caller can see.

Only repositories the caller may pull are listed or described (public ones, those
in namespaces the caller belongs to, everything for site admins), narrowed by an
API token's scopes; a repository the caller cannot see is 404, as on ``/v2/``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar

from litestar import Controller, Request, get
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException, ValidationException
from litestar.params import FromPath, Parameter
from sqlalchemy import ColumnElement, Select, func, select
from sqlalchemy.orm import Session

from forkd import jsondoc
from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.hub import accounts, authz, chains
from forkd.hub.auth import authenticate
from forkd.hub.db import contains_folded, like_literal
from forkd.hub.display import one_line, optional_line
from forkd.hub.models import Manifest, Repository, Tag
from forkd.hub.oci.common import in_chunks
from forkd.hub.params import QueryNumber, Sort, SortText, page_of, parse_sort
from forkd.hub.services import Hub
from forkd.names import validate_name, validate_tag
from forkd.pack import mediatypes as mt

# Tags per page of a repository's detail (the most, and the default).
TAGS_PER_PAGE = 100
SORTS: dict[Sort, ColumnElement[Any]] = {
    "updated": Repository.updated_at.desc(),
    "pulls": Repository.pull_count.desc(),
    "name": Repository.name.asc(),
}


@dataclass
class RepositorySummary:
    name: str
    namespace: str
    public: bool
    pulls: int
    tags: int
    updated_at: datetime


@dataclass
class RepositoryPage:
    items: list[RepositorySummary]
    page: int
    per_page: int
    total: int


@dataclass
class TagInfo:
    name: str
    digest: str
    media_type: str
    artifact_type: str | None
    size: int  # manifest plus every blob it references directly
    chain_depth: int  # how many ancestors through ``subject`` (0: a base)
    parent: str | None
    pushed_at: datetime
    pulls: int  # pulls of this tag (by tag, not by digest)


@dataclass
class RepositoryDetail:
    name: str
    namespace: str
    public: bool
    pulls: int
    created_at: datetime
    updated_at: datetime
    tags: list[TagInfo]  # one page, by name
    tags_total: int
    page: int
    per_page: int


async def _principal(hub: Hub, request: Request[object, object, State]) -> accounts.Principal:
    return (await authenticate(hub, request)).principal


class CatalogController(Controller):
    path = "/api/v1"
    tags: ClassVar[list[str]] = ["catalog"]  # type: ignore[misc]

    @get("/repositories")
    async def list_repositories(
        self,
        request: Request[object, object, State],
        hub: NamedDependency[Hub],
        q: Annotated[str | None, Parameter(max_length=255)] = None,
        namespace: Annotated[str | None, Parameter(max_length=255)] = None,
        sort: SortText = "updated",
        page: QueryNumber = None,
        per_page: QueryNumber = None,
    ) -> RepositoryPage:
        """Search (substring of the name) and list repositories, newest or most pulled first.
        ``page`` 1-100000 and ``per_page`` 1-100 (default 20) in ASCII digits."""
        pages = page_of(page, per_page, 20, 100)
        order = parse_sort(sort)
        principal = await _principal(hub, request)
        await hub.pulls.flush_for_read(hub.db)  # counts are batched: make them current first
        async with hub.db.reading() as session:
            where = [await session.run_sync(authz.visible, principal)]
            if q:
                where.append(contains_folded(Repository.name, q))  # A-Z as a-z, both backends
            if namespace:
                where.append(Repository.name.like(f"{like_literal(namespace)}/%", escape="\\"))
            total = await session.scalar(select(func.count()).select_from(Repository).where(*where))
            tag_count = (
                select(func.count())
                .where(Tag.repository_id == Repository.id)
                .correlate(Repository)
                .scalar_subquery()
            )
            query: Select[Any] = (
                select(Repository, tag_count)
                .where(*where)
                .order_by(SORTS[order], Repository.name)
                .offset(pages.offset)
                .limit(pages.size)
            )
            rows = (await session.execute(query)).all()
        items = [
            RepositorySummary(
                name=repo.name,
                namespace=accounts.namespace_of(repo.name),
                public=repo.is_public,
                pulls=repo.pull_count,
                tags=count,
                updated_at=repo.updated_at,
            )
            for repo, count in rows
        ]
        return RepositoryPage(items=items, page=pages.number, per_page=pages.size, total=total or 0)

    @get("/repositories/{name:path}")
    async def get_repository(
        self,
        request: Request[object, object, State],
        hub: NamedDependency[Hub],
        name: FromPath[str],
        page: QueryNumber = None,
        per_page: QueryNumber = None,
    ) -> RepositoryDetail:
        """A repository with one page of its tags (by name): size, chain depth, parent and
        push time of each; ``tags_total`` counts them all. ``page`` 1-100000, ``per_page``
        1-``TAGS_PER_PAGE`` (its default)."""
        pages = page_of(page, per_page, TAGS_PER_PAGE, TAGS_PER_PAGE)
        name = name.strip("/")
        try:
            validate_name(name)
        except InvalidInput as exc:
            raise ValidationException(str(exc)) from exc
        principal = await _principal(hub, request)
        await hub.pulls.flush_for_read(hub.db)  # counts are batched: make them current first
        async with hub.db.reading() as session:
            repo = (
                await session.scalars(
                    select(Repository).where(
                        Repository.name == name, await session.run_sync(authz.visible, principal)
                    )
                )
            ).first()
            if repo is None:
                raise NotFoundException(f"repository {name} not found")
            on_tag = (Manifest.repository_id == Tag.repository_id) & (
                Manifest.digest == Tag.manifest_digest
            )
            total = await session.scalar(
                select(func.count())
                .select_from(Tag)
                .join(Manifest, on_tag)
                .where(Tag.repository_id == repo.id)
            )
            rows = (
                await session.execute(
                    select(
                        Tag.name,
                        Tag.updated_at,
                        Tag.pull_count,
                        Manifest.digest,
                        Manifest.media_type,
                        Manifest.artifact_type,
                        Manifest.subject_digest,
                        Manifest.size,
                    )
                    .join(Manifest, on_tag)
                    .where(Tag.repository_id == repo.id)
                    .order_by(Tag.name)
                    .offset(pages.offset)
                    .limit(pages.size)
                )
            ).all()
            # The shown tags' chains only (never every manifest of the repository).
            found: dict[str, Manifest] = {}
            await session.run_sync(chains.load_chains, repo.id, {row.digest for row in rows}, found)
        # Read, hashed and parsed once per digest, in the fact readers' threads.
        sizes = await hub.sizes.many(
            functools.partial(_total_size, hub), [row.digest for row in rows], hub.readers.limiter()
        )
        depths = {row.digest: chains.depth(found, row.digest) for row in rows}
        tags = [
            TagInfo(
                name=row.name,
                digest=row.digest,
                # Checked at push since hostile review 19; a row from before, as a line.
                media_type=one_line(row.media_type),
                artifact_type=optional_line(row.artifact_type),
                size=sizes.get(row.digest) or row.size,
                chain_depth=depths[row.digest],
                parent=row.subject_digest,
                pushed_at=row.updated_at,
                pulls=row.pull_count,
            )
            for row in rows
        ]
        return RepositoryDetail(
            name=repo.name,
            namespace=accounts.namespace_of(repo.name),
            public=repo.is_public,
            pulls=repo.pull_count,
            created_at=repo.created_at,
            updated_at=repo.updated_at,
            tags=tags,
            tags_total=total or 0,
            page=pages.number,
            per_page=pages.size,
        )


@dataclass
class LineageNode:
    digest: str
    tags: list[str]
    parent: str | None  # subject digest
    parent_tag: str | None  # dev.forkd.parent.tag annotation
    compacted_from: str | None  # dev.forkd.compacted.from annotation
    depth: int  # distance from the asked-for manifest (ancestors and descendants)


@dataclass
class Lineage:
    repository: str
    tag: str
    head: LineageNode
    ancestors: list[LineageNode]  # nearest first
    descendants: list[LineageNode]  # breadth first


class LineageController(Controller):
    path = "/api/v1/lineage"
    tags: ClassVar[list[str]] = ["catalog"]  # type: ignore[misc]

    @get("/{name:path}")
    async def lineage(
        self,
        request: Request[object, object, State],
        hub: NamedDependency[Hub],
        name: FromPath[str],
        tag: Annotated[str, Parameter(max_length=128)],
    ) -> Lineage:
        """Ancestors (through ``subject``) and descendants (through referrers) of a tag."""
        name = name.strip("/")
        try:
            validate_name(name)
            validate_tag(tag)
        except InvalidInput as exc:
            raise ValidationException(str(exc)) from exc
        principal = await _principal(hub, request)
        async with hub.db.reading() as session:
            repo = (
                await session.scalars(
                    select(Repository).where(
                        Repository.name == name, await session.run_sync(authz.visible, principal)
                    )
                )
            ).first()
            if repo is None:
                raise NotFoundException(f"repository {name} not found")
            head_digest = await session.scalar(
                select(Tag.manifest_digest).where(Tag.repository_id == repo.id, Tag.name == tag)
            )
            fam = (
                await session.run_sync(chains.family, repo.id, head_digest)
                if head_digest is not None
                else None
            )
            if fam is None:
                raise NotFoundException(f"tag {tag} not found in {name}")
            named = {fam.head, *fam.ancestors, *(d for d, _ in fam.descendants)}
            notes_of = await session.run_sync(small_annotations, repo.id, named)

        def node(digest: str, depth: int) -> LineageNode:
            m = fam.found.get(digest)
            notes = annotations_of(notes_of.get(digest))
            return LineageNode(
                digest=digest,
                tags=fam.tags_of.get(digest, []),
                parent=m.subject_digest if m is not None else None,
                # A pusher's annotations are any strings (the OCI spec): shown as lines.
                parent_tag=_note(notes, mt.ANNOTATION_PARENT_TAG),
                compacted_from=_note(notes, mt.ANNOTATION_COMPACTED_FROM),
                depth=depth,
            )

        ancestors = [node(d, depth) for depth, d in enumerate(fam.ancestors, 1)]
        descendants = [node(d, depth) for d, depth in fam.descendants]
        return Lineage(name, tag, node(fam.head, 0), ancestors, descendants)


# Annotations a lineage or tag page reads per manifest: what forkd writes (parent tag,
# compacted-from, created) is a few hundred bytes; a pusher's may be a manifest's size.
NOTES_MAX = 4096


def small_annotations(
    session: Session, repository_id: int, digests: Iterable[str]
) -> dict[str, str]:
    """The stored annotations of those ``digests`` of the repository whose text is at most
    ``NOTES_MAX`` characters (the others read as none). Sync ORM code."""
    found: dict[str, str] = {}
    for chunk in in_chunks(digests):
        rows = session.execute(
            select(Manifest.digest, Manifest.annotations).where(
                Manifest.repository_id == repository_id,
                Manifest.digest.in_(chunk),
                Manifest.annotations.is_not(None),
                func.length(Manifest.annotations) <= NOTES_MAX,
            )
        )
        found.update({digest: text for digest, text in rows if text})
    return found


def _note(notes: dict[str, Any], key: str) -> str | None:
    """The annotation ``key`` as one line with its escapes visible (``display.one_line``);
    None when it is absent or not a string."""
    value = notes.get(key)
    return one_line(value) if isinstance(value, str) else None


def annotations_of(stored: str | None) -> dict[str, Any]:
    """A manifest row's stored annotations as an object ({} when absent or unreadable)."""
    if not stored:
        return {}
    try:
        notes = jsondoc.loads(stored, "manifest annotations")
    except InvalidInput:
        return {}
    return notes if isinstance(notes, dict) else {}


def _total_size(hub: Hub, digest: str) -> int | None:
    """The manifest's size plus every blob it references directly (config and layers),
    from its bytes (a worker thread: ``ManifestSizes``); None when they cannot be read
    now (then the tag shows the manifest's own size, and the next request tries again)."""
    limit = hub.settings.manifest_max_bytes
    try:
        body = hub.manifests.get(digest) or hub.blobs.read(digest, limit, "manifest")
    except (NotFound, IntegrityError, InvalidInput):  # missing, damaged or too big: the hub's
        return None
    try:
        doc = jsondoc.loads(body, "manifest")
    except (InvalidInput, ValueError):
        doc = None
    if not isinstance(doc, dict):
        return len(body)
    descriptors = [doc.get("config") or {}, *(doc.get("layers") or [])]
    sizes = [d.get("size") for d in descriptors if isinstance(d, dict)]
    return len(body) + sum(n for n in sizes if isinstance(n, int) and n >= 0)
