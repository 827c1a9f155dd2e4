"""What the pages show, read through the hub's models and the pack format's own parsers.

Repository visibility is ``forkd.hub.authz.visible``'s: a page never
shows what ``/api/v1`` or ``/v2/`` would hide. What a layer *is* (its config, memory
map, sizes) is read from its blobs with ``forkd.pack`` and cached by manifest digest:
a digest names immutable bytes, so the cache never goes stale.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
from sqlalchemy import ColumnElement, Select, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from forkd.errors import ForkdError
from forkd.hub import accounts, authz, chains
from forkd.hub.catalog import (
    NOTES_MAX,
    annotations_of,
)
from forkd.hub.db import contains_folded, like_literal
from forkd.hub.models import Manifest as ManifestRow
from forkd.hub.models import Membership, Namespace, Repository, Tag, User
from forkd.hub.services import FACTS_READERS, Hub, LazyLimiter
from forkd.pack import mediatypes as mt
from forkd.pack.config import MAX_CONFIG_BYTES, SnapshotConfig
from forkd.pack.imagemap import PAGE_SIZE, ImageMap, check_map_size
from forkd.pack.manifest import MAX_MANIFEST_BYTES
from forkd.pack.manifest import Manifest as PackManifest

FACTS_CACHE = 4096
TAGS_PER_PAGE = 50  # tags a pack page lists (and reads the facts of)
# Scan at most this many tag heads when a filter needs config facts (VMM, accelerators).
FILTER_SCAN_LIMIT = 5000
# What a VMM / without-KVM filter reads: each pack's newest tags, and at most this many
# distinct manifests' facts per search (under FACTS_CACHE: a repeated search is cached).
FILTER_TAGS_PER_PACK = 10
FILTER_SCAN_FACTS = 2000


# -- facts about one layer (one manifest digest) --------------------------------
@dataclass(frozen=True)
class ImageFacts:
    role: str  # "memory" or "disk"
    kind: str  # "flat" or "diff"
    size: int  # the image's full size
    provided: int  # bytes of pages this layer defines
    zero: int  # bytes of pages this layer sets to zero
    stored: int  # compressed chunk bytes
    chunks: int


@dataclass(frozen=True)
class LayerFacts:
    digest: str
    manifest_size: int
    stored: int  # manifest + every blob it references, each once
    config: SnapshotConfig | None  # None: not a forkd snapshot (another OCI artifact)
    with_maps: bool  # whether ``images`` was read (tag pages need it, listings do not)
    images: tuple[ImageFacts, ...] = ()
    blobs: tuple[tuple[str, int, int], ...] = ()  # (kind, count, bytes) by layer media type
    error: str = ""

    @property
    def memory(self) -> ImageFacts | None:
        return next((i for i in self.images if i.role == "memory"), None)

    @property
    def vmm(self) -> str:
        return self.config.compat.vmm if self.config and self.config.compat else ""

    @property
    def without_kvm(self) -> bool:
        compat = self.config.compat if self.config else None
        return compat is not None and "tcg" in compat.accelerators


_KINDS = {
    mt.CONFIG: "config",
    mt.MEMORY_MAP: "memory map",
    mt.MEMORY_CHUNK: "memory chunks",
    mt.DISK_MAP: "disk map",
    mt.DISK_CHUNK: "disk chunks",
    mt.VMSTATE: "device state",
    mt.KERNEL: "kernel",
    mt.INITRD: "initramfs",
}


class FactsCache:
    """LayerFacts by manifest digest, read from the blob store once (bounded LRU).

    Only the small facts are kept, never a map. Reads run in worker threads, at most
    ``FACTS_READERS`` at a time (``readers``: the hub's, shared with the API's tag sizes),
    and once per digest: a request wanting facts another request is reading waits for
    them instead of parsing the same map again."""

    def __init__(self, limit: int = FACTS_CACHE, readers: LazyLimiter | None = None) -> None:
        self._limit = limit
        self._items: OrderedDict[str, LayerFacts] = OrderedDict()
        self._lock = threading.Lock()
        self._reading: dict[str, anyio.Event] = {}
        self._readers = readers or LazyLimiter(FACTS_READERS)

    def _read(self, hub: Hub, digest: str, size: int, maps: bool) -> LayerFacts:
        try:
            raw = hub.blobs.read(digest, MAX_MANIFEST_BYTES, "manifest")
            manifest = PackManifest.from_bytes(raw, f"manifest {digest}")
            cfg = SnapshotConfig.from_bytes(
                hub.blobs.read(manifest.config.digest, MAX_CONFIG_BYTES, "config"),
                f"config of {digest}",
            )
            images = []
            for role, desc in manifest.maps.items() if maps else ():
                what = f"{role} map of {digest}"
                check_map_size(desc.size, what)  # before reading what the descriptor declares
                imap = ImageMap.from_bytes(hub.blobs.read(desc.digest, desc.size, what), what)
                images.append(
                    ImageFacts(
                        role,
                        imap.kind,
                        imap.size,
                        imap.provided_pages * PAGE_SIZE,
                        sum(n for _, n in imap.zero) * PAGE_SIZE,
                        imap.stored_bytes,
                        len(imap.chunks),
                    )
                )
        except (ForkdError, ValueError) as exc:
            return LayerFacts(digest, size, size, None, maps, error=str(exc)[:300])
        unique = manifest.blobs()
        kinds: dict[str, list[int]] = {}
        for d in unique:
            entry = kinds.setdefault(_KINDS.get(d.media_type, d.media_type), [0, 0])
            entry[0] += 1
            entry[1] += d.size
        return LayerFacts(
            digest,
            size,
            size + sum(d.size for d in unique),
            cfg,
            maps,
            tuple(images),
            tuple((k, v[0], v[1]) for k, v in kinds.items()),
        )

    def _hit(self, digest: str, maps: bool) -> LayerFacts | None:
        """Cached facts good enough for the request (the caller holds the lock)."""
        hit = self._items.get(digest)
        if hit is not None and (hit.with_maps or not maps):
            self._items.move_to_end(digest)
            return hit
        return None

    def _load(self, hub: Hub, wanted: dict[str, int], maps: bool) -> dict[str, LayerFacts]:
        """Read facts from the blob store and cache them (a worker thread)."""
        out = {d: self._read(hub, d, size, maps) for d, size in wanted.items()}
        with self._lock:
            self._items.update(out)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)
        return out

    async def many(
        self, hub: Hub, wanted: Iterable[tuple[str, int]], maps: bool = False
    ) -> dict[str, LayerFacts]:
        """Facts for many manifests; with ``maps``, also their image maps (tag pages).
        Blob reads and parsing happen in worker threads, never on the event loop."""
        items = dict(wanted)
        found: dict[str, LayerFacts] = {}
        while len(found) < len(items):
            todo: dict[str, int] = {}
            waiting: list[anyio.Event] = []
            with self._lock:
                for d, size in items.items():
                    if d in found:
                        continue
                    hit = self._hit(d, maps)
                    if hit is not None:
                        found[d] = hit
                    elif d in self._reading:
                        waiting.append(self._reading[d])
                    else:
                        todo[d] = size
                mine = {d: anyio.Event() for d in todo}
                self._reading.update(mine)
            if todo:
                try:
                    found.update(
                        await anyio.to_thread.run_sync(
                            self._load, hub, todo, maps, limiter=self._readers.limiter()
                        )
                    )
                finally:
                    with self._lock:
                        for d, event in mine.items():
                            del self._reading[d]
                            event.set()
            for event in waiting:  # another request reads these: then take them from the cache
                await event.wait()
        return found


# -- listing --------------------------------------------------------------------
@dataclass
class PackSummary:
    name: str
    namespace: str
    description: str
    public: bool
    pulls: int
    tags: int
    updated_at: datetime


@dataclass(frozen=True)
class Filters:
    q: str = ""
    namespace: str = ""
    vmm: str = ""
    without_kvm: bool = False
    chain: bool = False
    sort: str = "updated"

    @property
    def needs_facts(self) -> bool:
        return bool(self.vmm) or self.without_kvm

    @property
    def active(self) -> bool:
        return bool(self.q or self.namespace or self.vmm or self.without_kvm or self.chain)


SORTS: dict[str, tuple[ColumnElement[Any], ...]] = {
    "updated": (Repository.updated_at.desc(), Repository.name.asc()),
    "pulls": (Repository.pull_count.desc(), Repository.name.asc()),
    "name": (Repository.name.asc(),),
}


def tag_count() -> Any:
    return (
        select(func.count())
        .where(Tag.repository_id == Repository.id)
        .correlate(Repository)
        .scalar_subquery()
    )


def summary(repo: Repository, tags: int) -> PackSummary:
    return PackSummary(
        repo.name,
        accounts.namespace_of(repo.name),
        repo.description,
        repo.is_public,
        repo.pull_count,
        tags,
        repo.updated_at,
    )


async def search(
    hub: Hub,
    facts: FactsCache,
    principal: accounts.Principal,
    filters: Filters,
    page: int,
    per_page: int,
) -> tuple[list[PackSummary], int]:
    """One page of the packs ``principal`` may see that match ``filters``, and the total."""
    await hub.pulls.flush_for_read(hub.db)  # pull counts are batched: make them current first
    async with hub.db.reading() as session:
        where = [await session.run_sync(authz.visible, principal)]
        if filters.q:
            # Ignoring the case of A-Z, on both backends (LIKE alone ignored it on SQLite
            # only: "Debian" found "debian base" there and nothing on PostgreSQL).
            where.append(
                or_(
                    contains_folded(Repository.name, filters.q),
                    contains_folded(Repository.description, filters.q),
                )
            )
        if filters.namespace:
            where.append(Repository.name.like(f"{like_literal(filters.namespace)}/%", escape="\\"))
        if filters.chain:
            where.append(
                exists(
                    select(Tag.name)
                    .join(
                        ManifestRow,
                        (ManifestRow.repository_id == Tag.repository_id)
                        & (ManifestRow.digest == Tag.manifest_digest),
                    )
                    .where(Tag.repository_id == Repository.id)
                    .where(ManifestRow.subject_digest.is_not(None))
                )
            )
        query: Select[Any] = select(Repository, tag_count()).where(*where)
        query = query.order_by(*SORTS[filters.sort])
        if not filters.needs_facts:
            total = await session.scalar(select(func.count()).select_from(Repository).where(*where))
            rows = (
                await session.execute(query.offset((page - 1) * per_page).limit(per_page))
            ).all()
            return [summary(repo, n) for repo, n in rows], total or 0
        rows = (await session.execute(query.limit(FILTER_SCAN_LIMIT))).all()
        # Each pack's newest FILTER_TAGS_PER_PACK tags (facts are blob reads: an anonymous
        # search read every tag of thousands of packs, two reads per tag).
        ranked = (
            select(
                Tag.repository_id.label("repository_id"),
                ManifestRow.digest.label("digest"),
                ManifestRow.size.label("size"),
                func.row_number()
                .over(
                    partition_by=Tag.repository_id,
                    order_by=(Tag.updated_at.desc(), Tag.name),
                )
                .label("rank"),
            )
            .join(
                ManifestRow,
                (ManifestRow.repository_id == Tag.repository_id)
                & (ManifestRow.digest == Tag.manifest_digest),
            )
            .where(Tag.repository_id.in_([repo.id for repo, _ in rows]))
            .subquery()
        )
        found = (
            await session.execute(
                select(ranked.c.repository_id, ranked.c.digest, ranked.c.size).where(
                    ranked.c.rank <= FILTER_TAGS_PER_PACK
                )
            )
        ).all()
    by_repo: dict[int, list[tuple[str, int]]] = {}
    for repo_id, digest, size in found:
        by_repo.setdefault(repo_id, []).append((digest, size))
    # At most FILTER_SCAN_FACTS distinct manifests per search, packs in the sort's order.
    wanted: dict[str, int] = {}
    considered: list[tuple[Repository, int]] = []
    for repo, n in rows:
        mine = dict(by_repo.get(repo.id, []))
        if len(wanted.keys() | mine.keys()) > FILTER_SCAN_FACTS:
            break
        wanted.update(mine)
        considered.append((repo, n))
    rows = considered
    heads = [(repo.id, d, size) for repo, _ in rows for d, size in by_repo.get(repo.id, [])]
    known = await facts.many(hub, wanted.items())
    matching: set[int] = set()
    for repo_id, digest, _ in heads:
        f = known[digest]
        if filters.vmm and f.vmm != filters.vmm:
            continue
        if filters.without_kvm and not f.without_kvm:
            continue
        matching.add(repo_id)
    hits = [summary(repo, n) for repo, n in rows if repo.id in matching]
    return hits[(page - 1) * per_page : page * per_page], len(hits)


# -- one repository ------------------------------------------------------------
@dataclass
class TagRow:
    name: str
    digest: str
    pushed_at: datetime
    depth: int
    facts: LayerFacts
    pulls: int


@dataclass
class PackDetail:
    repo: Repository
    namespace: str
    tags: list[TagRow]  # one page of them (by name), with their facts
    can_push: bool
    featured: TagRow | None  # whose compat metadata the page shows
    tags_total: int = 0
    page: int = 1
    pages: int = 1


async def _visible_repository(
    session: AsyncSession, principal: accounts.Principal, name: str
) -> Repository | None:
    return (
        await session.scalars(
            select(Repository).where(
                Repository.name == name, await session.run_sync(authz.visible, principal)
            )
        )
    ).first()


# A tag whose manifest the repository has (the only ones a page lists).
ON_TAG = (ManifestRow.repository_id == Tag.repository_id) & (
    ManifestRow.digest == Tag.manifest_digest
)


async def pack(
    hub: Hub,
    facts: FactsCache,
    principal: accounts.Principal,
    name: str,
    page: int = 1,
) -> PackDetail | None:
    """A repository with one ``page`` of its tags (``TAGS_PER_PAGE``, by name) and the
    tag whose compat metadata the page shows (``latest``, else the newest push), with the
    facts and chain depths of those. None when it does not exist or ``principal`` cannot
    see it.

    Bounded whatever the repository holds: the facts of a tag are blob reads (its manifest
    and config; S3 GETs), and the rows read are that page's tags and their chains
    (hub/chains.py), never every manifest or tag of the repository."""
    await hub.pulls.flush_for_read(hub.db)  # pull counts are batched: make them current first
    async with hub.db.reading() as session:
        repo = await _visible_repository(session, principal, name)
        if repo is None:
            return None
        present = select(Tag).join(ManifestRow, ON_TAG).where(Tag.repository_id == repo.id)
        total = (
            await session.scalar(
                select(func.count())
                .select_from(Tag)
                .join(ManifestRow, ON_TAG)
                .where(Tag.repository_id == repo.id)
            )
            or 0
        )
        shown = list(
            (
                await session.scalars(
                    present.order_by(Tag.name)
                    .offset((page - 1) * TAGS_PER_PAGE)
                    .limit(TAGS_PER_PAGE)
                )
            ).all()
        )
        featured = (await session.scalars(present.where(Tag.name == "latest"))).first() or (
            await session.scalars(present.order_by(Tag.updated_at.desc(), Tag.name).limit(1))
        ).first()
        wanted = [*shown, featured] if featured is not None else shown
        found: dict[str, ManifestRow] = {}
        await session.run_sync(
            chains.load_chains, repo.id, {t.manifest_digest for t in wanted}, found
        )
        _, held = await session.run_sync(authz.repository_access, principal, name)
        can_push = "push" in held
    known = await facts.many(
        hub, ((t.manifest_digest, found[t.manifest_digest].size) for t in wanted)
    )

    def row(t: Tag) -> TagRow:
        return TagRow(
            t.name,
            t.manifest_digest,
            t.updated_at,
            chains.depth(found, t.manifest_digest),
            known[t.manifest_digest],
            t.pull_count,
        )

    return PackDetail(
        repo,
        accounts.namespace_of(name),
        [row(t) for t in shown],
        can_push,
        row(featured) if featured is not None else None,
        total,
        page,
        max(1, -(-total // TAGS_PER_PAGE)),
    )


@dataclass
class TagDetail:
    """A tag page's reads: the manifest, its lineage (hub/chains.py ``Family``: its
    chain, its descendants, the chains of compactions' other ends, their tag names)."""

    repo: Repository
    namespace: str
    digest: str
    tagged: bool  # named by a tag (else by its digest)
    family: chains.Family
    compacted_from: dict[str, str]  # flat → source digest (``_compaction_sources``)


async def tag(
    hub: Hub, principal: accounts.Principal, name: str, ref: str
) -> TagDetail | Repository | None:
    """A tag page's reads for ``ref`` (a valid tag or digest): the TagDetail; the
    repository alone when it has no such tag or manifest; None when there is no
    repository ``name`` that ``principal`` can see."""
    async with hub.db.reading() as session:
        repo = await _visible_repository(session, principal, name)
        if repo is None:
            return None
        tagged = not ref.startswith(("sha256:", "sha512:"))
        digest = (
            await session.scalar(
                select(Tag.manifest_digest).where(Tag.repository_id == repo.id, Tag.name == ref)
            )
            if tagged
            else ref
        )
        fam = await session.run_sync(chains.family, repo.id, digest) if digest is not None else None
        if fam is None:
            return repo
        compacted = await session.run_sync(_compaction_sources, repo.id)
        named = {fam.head, *fam.ancestors, *(d for d, _ in fam.descendants)}
        ends = {flat for flat, src in compacted.items() if src in named}
        ends |= {compacted[d] for d in named if d in compacted}
        await session.run_sync(chains.with_chains, repo.id, fam, ends - named)
    return TagDetail(repo, accounts.namespace_of(name), fam.head, tagged, fam, compacted)


# Compaction links a tag page reads (the newest), and so draws at most: each is a node of
# its lineage graph with its own chain and tag names, and any pusher of the repository
# adds them (a manifest annotated ``dev.forkd.compacted.from``). 10,000 of them were a
# read per node and a graph of 10,000 nodes on every view of the page.
COMPACTION_NOTES_MAX = chains.MAX_CHAIN


def _compaction_sources(session: Session, repository_id: int) -> dict[str, str]:
    """flat layer → the digest it was compacted from, for the repository's newest
    ``COMPACTION_NOTES_MAX`` manifests whose annotations name one
    (``dev.forkd.compacted.from``) in at most ``NOTES_MAX`` characters. Sync ORM code."""
    key = like_literal(mt.ANNOTATION_COMPACTED_FROM)
    rows = session.execute(
        select(ManifestRow.digest, ManifestRow.annotations)
        .where(
            ManifestRow.repository_id == repository_id,
            ManifestRow.annotations.like(f"%{key}%", escape="\\"),
            func.length(ManifestRow.annotations) <= NOTES_MAX,
        )
        .order_by(ManifestRow.created_at.desc(), ManifestRow.digest)
        .limit(COMPACTION_NOTES_MAX)
    )
    out: dict[str, str] = {}
    for digest, text in rows:
        value = annotations_of(text).get(mt.ANNOTATION_COMPACTED_FROM)
        if isinstance(value, str) and "@" in value:
            out[digest] = value.rsplit("@", 1)[1]
    return out


# -- a tag: its chain and its lineage graph --------------------------------------
@dataclass
class ChainLayer:
    digest: str
    tags: list[str]
    facts: LayerFacts


@dataclass
class GraphNode:
    digest: str
    label: str
    tags: list[str]
    level: int
    current: bool
    compacted: bool
    x: int = 0
    y: int = 0


@dataclass
class GraphEdge:
    source: str
    target: str
    kind: str  # "parent" or "compaction"
    x1: int = 0
    y1: int = 0
    x2: int = 0
    y2: int = 0


@dataclass
class Graph:
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    width: int
    height: int
    ancestors: list[str] = field(default_factory=list)
    descendants: list[str] = field(default_factory=list)
    compactions: list[tuple[str, str]] = field(default_factory=list)


NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 150, 34, 24, 40, 12


async def chain_layers(hub: Hub, facts: FactsCache, detail: TagDetail) -> list[ChainLayer]:
    """The tag's chain, head first, with each layer's facts (its map read too)."""
    found = detail.family.found
    digests = [d for d in chains.chain(found, detail.digest) if d in found]
    known = await facts.many(hub, ((d, found[d].size) for d in digests), maps=True)
    return [ChainLayer(d, detail.family.tags_of.get(d, []), known[d]) for d in digests]


def lineage(detail: TagDetail) -> Graph:
    """Ancestors, descendants and compaction links of the tag, laid out for SVG."""
    fam, head = detail.family, detail.digest
    manifests = fam.found
    compacted_into: dict[str, list[str]] = {}
    for flat, source in detail.compacted_from.items():
        compacted_into.setdefault(source, []).append(flat)
    ancestors = fam.ancestors
    descendants = [d for d, _ in fam.descendants]
    seen = {head, *ancestors, *descendants}
    family = [*reversed(ancestors), head, *descendants]
    compactions: list[tuple[str, str]] = []
    for d in list(family):
        for flat in sorted(compacted_into.get(d, [])):
            compactions.append((d, flat))
        src = detail.compacted_from.get(d)
        if src is not None:
            compactions.append((src, d))
    # A compaction's other end comes with its own ancestors, so the flat layer's page shows
    # the chain it replaced.
    extra: list[str] = []
    for pair in compactions:
        for x in pair:
            if x in seen or x not in manifests:
                continue
            for y in reversed(chains.chain(manifests, x)):
                if y not in seen:
                    seen.add(y)
                    extra.append(y)
    nodes_order = family + extra

    subjects = {d: m.subject_digest for d, m in manifests.items()}
    level = {d: chains.depth(manifests, d) for d in nodes_order}
    for src, flat in compactions:  # a flat layer sits one row below what it came from
        if flat in level and src in level and manifests.get(flat) and not subjects.get(flat):
            level[flat] = max(level[flat], level[src] + 1)
    rows: dict[int, list[str]] = {}
    for d in nodes_order:
        rows.setdefault(level[d], []).append(d)
    width = max((len(r) for r in rows.values()), default=1) * (NODE_W + GAP_X) - GAP_X + 2 * PAD
    nodes: dict[str, GraphNode] = {}
    compacted_nodes = {flat for _, flat in compactions}
    for row_index, lvl in enumerate(sorted(rows)):
        for col, d in enumerate(rows[lvl]):
            tags = fam.tags_of.get(d, [])
            nodes[d] = GraphNode(
                d,
                tags[0] if tags else d.split(":", 1)[-1][:12],
                tags,
                lvl,
                d == head,
                d in compacted_nodes,
                PAD + col * (NODE_W + GAP_X),
                PAD + row_index * (NODE_H + GAP_Y),
            )
    edges: list[GraphEdge] = []
    for d in nodes_order:
        up = subjects.get(d)
        if up is not None and up in nodes:
            edges.append(GraphEdge(up, d, "parent"))
    for src, flat in compactions:
        if src in nodes and flat in nodes:
            edges.append(GraphEdge(src, flat, "compaction"))
    for e in edges:
        a, b = nodes[e.source], nodes[e.target]
        e.x1, e.y1 = a.x + NODE_W // 2, a.y + NODE_H
        e.x2, e.y2 = b.x + NODE_W // 2, b.y
    height = len(rows) * (NODE_H + GAP_Y) - GAP_Y + 2 * PAD
    return Graph(list(nodes.values()), edges, width, height, ancestors, descendants, compactions)


# -- namespaces, members, tokens ----------------------------------------------
@dataclass
class Member:
    name: str
    role: str
    robot: bool


async def namespace_members(session: AsyncSession, ns: Namespace) -> list[Member]:
    rows = (
        await session.execute(
            select(User.name, Membership.role, User.is_robot)
            .join(Membership, Membership.user_id == User.id)
            .where(Membership.namespace_id == ns.id)
            .order_by(User.name)
        )
    ).all()
    return [Member(name, role, robot) for name, role, robot in rows]


async def role_in(session: AsyncSession, principal: accounts.Principal, ns: Namespace) -> str:
    """``principal``'s role in ``ns`` ('' when none), as ``authz`` decides it."""
    return await session.run_sync(authz.namespace_role, principal, ns.name) or ""


async def admin_namespaces(
    session: AsyncSession,
    principal: accounts.Principal,
    kind: str | None = None,
    *,
    limit: int | None = None,
) -> list[str]:
    """Namespaces whose robots and members ``principal`` may manage (``kind``: only those
    of that kind; ``limit``: the first that many, by name)."""
    return await session.run_sync(
        functools.partial(authz.admin_namespaces, kind=kind, limit=limit), principal
    )
