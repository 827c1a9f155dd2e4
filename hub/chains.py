"""A repository's manifest graph, read a bounded piece at a time.

A manifest names its parent through ``subject`` (a chain: head → … → base), and any number
of manifests may name one subject (its descendants: each referrer anyone who may push adds).
A view about a few heads (the pack page, a tag page, the catalog and lineage APIs) reads
those heads' chains, a capped breadth-first set of descendants and a capped number of tag
names per manifest: never every manifest or tag of the repository, so a signed-out view of
a public pack with a hundred thousand manifests or tags costs what one with ten does.
Every read is by an index of the repository's own rows (``manifests (repository_id,
digest)``, ``manifests (repository_id, subject_digest, digest)``, ``tags (repository_id,
manifest_digest, name)``): never through rows of other repositories, which a ``subject``
naming this repository's digests could add without limit. Sync ORM code (``session.run_sync``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from forkd.hub.models import Manifest, Tag
from forkd.hub.oci.common import in_chunks

MAX_CHAIN = 256  # ancestors of a head, and descendants in all, a view reads
TAG_NAMES_MAX = 100  # tag names a view reads per manifest (by name)


def manifests(session: Session, repo_id: int, digests: Iterable[str]) -> dict[str, Manifest]:
    """The repository's manifests of those ``digests`` (the ones it has), without their
    annotations (each up to a manifest's size: ``catalog.small_annotations`` reads them)."""
    found: dict[str, Manifest] = {}
    for chunk in in_chunks(sorted(set(digests))):
        rows = session.scalars(
            select(Manifest)
            .options(defer(Manifest.annotations, raiseload=True))
            .where(Manifest.repository_id == repo_id, Manifest.digest.in_(chunk))
        )
        found.update((m.digest, m) for m in rows)
    return found


def load_chains(
    session: Session,
    repo_id: int,
    heads: Iterable[str],
    into: dict[str, Manifest],
    *,
    most: int | None = None,
) -> None:
    """Add ``heads`` and up to ``MAX_CHAIN`` ancestors of each to ``into`` (what it holds
    already is not read again): one query per level of the chains, whatever their number.
    ``most``: ``into`` holds at most that many manifests after (then the nearest levels
    are read first, each level's digests in order)."""
    level = set(heads)
    for _ in range(MAX_CHAIN + 1):
        wanted = sorted(d for d in level if d not in into)
        if most is not None:
            wanted = wanted[: max(0, most - len(into))]
        into.update(manifests(session, repo_id, wanted))
        level = {
            subject for d in level if d in into and (subject := into[d].subject_digest) is not None
        }
        if not level:
            return


def chain(found: dict[str, Manifest], head: str) -> list[str]:
    """head → … → base through ``subject`` in ``found`` (``load_chains``): at most
    ``MAX_CHAIN`` ancestors, cycle-safe. The last may be a digest the repository lacks."""
    out, seen = [head], {head}
    current = found[head].subject_digest if head in found else None
    while current is not None and current not in seen and len(out) <= MAX_CHAIN:
        out.append(current)
        seen.add(current)
        parent = found.get(current)
        current = parent.subject_digest if parent is not None else None
    return out


def depth(found: dict[str, Manifest], head: str) -> int:
    """Ancestors of ``head`` (capped at ``MAX_CHAIN``)."""
    return len(chain(found, head)) - 1


def descendants(session: Session, repo_id: int, head: str, seen: set[str]) -> list[tuple[str, int]]:
    """The manifests under ``head`` through ``subject``, breadth first (each parent's
    children by digest), with their distance from ``head``; at most ``MAX_CHAIN`` in all,
    not per level, and none of ``seen`` (the head's chain)."""
    out: list[tuple[str, int]] = []
    visited = {head, *seen}
    frontier, level = [head], 0
    while frontier and level < MAX_CHAIN and len(out) < MAX_CHAIN:
        level += 1
        nxt: list[str] = []
        for parent in frontier:
            room = MAX_CHAIN - len(out)
            if room <= 0:
                break
            # Room for what is left plus every one already visited (skipped below).
            children = session.scalars(
                select(Manifest.digest)
                .where(Manifest.repository_id == repo_id, Manifest.subject_digest == parent)
                .order_by(Manifest.digest)
                .limit(room + len(visited))
            ).all()
            for child in children:
                if child not in visited and len(out) < MAX_CHAIN:
                    visited.add(child)
                    out.append((child, level))
                    nxt.append(child)
        frontier = nxt
    return out


def tag_names(session: Session, repo_id: int, digests: Iterable[str]) -> dict[str, list[str]]:
    """digest → the names of the repository's tags on it, by name: at most
    ``TAG_NAMES_MAX`` each (any number of tags may name one manifest)."""
    out: dict[str, list[str]] = {}
    for digest in sorted(set(digests)):
        names = session.scalars(
            select(Tag.name)
            .where(Tag.repository_id == repo_id, Tag.manifest_digest == digest)
            .order_by(Tag.name)
            .limit(TAG_NAMES_MAX)
        ).all()
        if names:
            out[digest] = list(names)
    return out


@dataclass
class Family:
    """What a lineage of ``head`` names: its chain and its descendants, their manifests
    (``found``: those and the chains of anything added by ``with_chains``) and tags."""

    head: str
    ancestors: list[str]  # nearest first
    descendants: list[tuple[str, int]]  # (digest, distance), breadth first
    found: dict[str, Manifest]
    tags_of: dict[str, list[str]] = field(default_factory=dict)


def family(session: Session, repo_id: int, head: str) -> Family | None:
    """The lineage of ``head`` (None when the repository has no such manifest), with the
    tag names of every manifest it names."""
    found: dict[str, Manifest] = {}
    load_chains(session, repo_id, [head], found)
    if head not in found:
        return None
    ancestors = chain(found, head)[1:]
    down = descendants(session, repo_id, head, set(ancestors))
    found.update(manifests(session, repo_id, (d for d, _ in down)))
    fam = Family(head, ancestors, down, found)
    fam.tags_of = tag_names(session, repo_id, [head, *ancestors, *(d for d, _ in down)])
    return fam


def with_chains(session: Session, repo_id: int, fam: Family, more: Iterable[str]) -> None:
    """Add ``more`` manifests and their chains to ``fam`` (a lineage page draws the chain a
    compaction replaced), with their tag names: ``MAX_CHAIN`` manifests at most in all,
    however many ``more`` names (each of them could head a chain of ``MAX_CHAIN``)."""
    before = set(fam.found)
    load_chains(session, repo_id, more, fam.found, most=len(before) + MAX_CHAIN)
    fam.tags_of.update(tag_names(session, repo_id, set(fam.found) - before))
