"""Chains of layers: walking parent edges, and flattening their maps without touching data.

A chain is ``head → parent → … → base`` through each manifest's ``subject``.
Flattening merges the layers' image maps, newest first, into the list of
page ranges each chunk still provides (what newer layers did not overwrite),
so assembly reads every needed chunk once and writes every needed byte once.
Its cost follows the maps' extents, never the image size the maps declare:
pages no layer provides (holes, zero extents) are never listed or visited.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from forkd.errors import ChainError
from forkd.pack.imagemap import ChunkRef, Extent, ImageMap
from forkd.pack.manifest import Manifest

MAX_CHAIN_DEPTH = 64


@dataclass(frozen=True)
class Link:
    digest: str
    manifest: Manifest


def walk(
    head: str,
    load: Callable[[str], Manifest],
    max_depth: int = MAX_CHAIN_DEPTH,
    name: str = "",
) -> list[Link]:
    """The chain from ``head`` to its base, newest first; refuses cycles and over-deep chains."""
    label = name or head
    chain: list[Link] = []
    seen: set[str] = set()
    digest: str | None = head
    while digest is not None:
        if digest in seen:
            raise ChainError(
                f"chain of {label} has a cycle at {digest}; the pack is corrupt — remove it "
                "and pull or import it again"
            )
        if len(chain) > max_depth:
            raise ChainError(
                f"chain of {label} is deeper than the cap of {max_depth} layers; compact it "
                "(forkd compact) before using it"
            )
        seen.add(digest)
        manifest = load(digest)
        chain.append(Link(digest, manifest))
        digest = manifest.subject.digest if manifest.subject else None
    return chain


@dataclass(frozen=True)
class Piece:
    """Copy ``count`` pages from page ``chunk_page`` of a chunk to image page ``page``."""

    chunk_page: int
    page: int
    count: int


Plan = list[tuple[ChunkRef, list[Piece]]]  # each chunk still needed, with its pieces


class _Covered:
    """Disjoint, sorted page intervals already provided by newer layers."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def uncovered(self, a: int, b: int) -> list[Extent]:
        out: list[Extent] = []
        i = bisect.bisect_right(self.ends, a)
        pos = a
        while i < len(self.starts) and self.starts[i] < b:
            if self.starts[i] > pos:
                out.append((pos, self.starts[i] - pos))
            pos = max(pos, self.ends[i])
            i += 1
        if pos < b:
            out.append((pos, b - pos))
        return out

    def merge(self, extents: list[Extent]) -> None:
        """Union with a sorted list of extents, in one linear pass."""
        merged: list[tuple[int, int]] = []
        ours = list(zip(self.starts, self.ends, strict=True))
        theirs = [(a, a + n) for a, n in extents]
        i = j = 0
        while i < len(ours) or j < len(theirs):
            if j == len(theirs) or (i < len(ours) and ours[i][0] <= theirs[j][0]):
                a, b = ours[i]
                i += 1
            else:
                a, b = theirs[j]
                j += 1
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]


def flatten(maps: list[ImageMap], what: str) -> Plan:
    """Merge maps (newest first) into the surviving pieces of each chunk, oldest layers last.

    Pages nobody provides are zero. The first ``flat`` map ends the walk.
    """
    if not maps:
        raise ChainError(f"{what}: no layers to assemble")
    size = maps[0].size
    covered = _Covered()
    plan: Plan = []
    for imap in maps:
        if imap.size != size:
            raise ChainError(
                f"{what}: layer sizes differ ({imap.size} vs {size} bytes); the chain is corrupt"
            )
        layer_extents: list[Extent] = list(imap.zero)
        for chunk in imap.chunks:
            pieces: list[Piece] = []
            chunk_page = 0
            for first, n in chunk.extents:
                for start, count in covered.uncovered(first, first + n):
                    pieces.append(Piece(chunk_page + start - first, start, count))
                chunk_page += n
            if pieces:
                plan.append((chunk, pieces))
            layer_extents.extend(chunk.extents)
        if imap.kind == "flat":
            return plan
        layer_extents.sort()
        covered.merge(layer_extents)
    raise ChainError(f"{what}: the chain ends in a diff layer with no flat base; it is incomplete")


def written_extents(plan: Plan) -> list[Extent]:
    """The page extents (sorted, adjacent ones merged) that ``plan`` writes: every other
    page of the assembled image is a hole, zero. As many as the plan's pieces, at most."""
    out: list[Extent] = []
    for page, count in sorted((p.page, p.count) for _, pieces in plan for p in pieces):
        if out and out[-1][0] + out[-1][1] == page:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((page, count))
    return out
