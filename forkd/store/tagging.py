"""Tags set, moved and removed: a tag names a manifest whose chain the store holds, and a
tag that is some other tag's parent goes only with its dependents (``--cascade``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from forkd import digest as dg
from forkd.errors import Conflict, NotFound
from forkd.names import Ref, parse_ref

if TYPE_CHECKING:
    from forkd.store.store import Store


def tag(store: Store, ref: str, source: str, force: bool = False) -> str:
    """Point tag ``ref`` at what ``source`` (a tag or a manifest digest) names."""
    target = parse_ref(ref)
    digest = source if source.startswith("sha256:") else store.resolve(source)
    store.chain(dg.validate(digest), str(target))  # the manifest and its chain must be here
    if not force and store.tags.read().get(str(target), digest) != digest:
        raise Conflict(f"tag {target} exists; pick another tag or pass --force to replace it")
    set_tag(store, target, digest, force)
    return digest


def set_tag(store: Store, ref: Ref, digest: str, force: bool) -> None:
    def change(tags: dict[str, str]) -> None:
        if not force and tags.get(str(ref), digest) != digest:
            raise Conflict(
                f"tag {ref} was created meanwhile by another process; pass --force to replace it"
            )
        tags[str(ref)] = digest

    store.tags.update(change)


def dependents(store: Store, ref: Ref, tags: dict[str, str] | None = None) -> list[str]:
    """Tags built on the layer ``ref`` names that would lose its last name: none while
    another tag (a twin, same digest) still names it. ``tags``: the tags to look in (read
    under the tags' lock by remove), else the store's now."""
    tags = store.tags.read() if tags is None else tags
    digest = tags.get(str(ref))
    if any(head == digest for name, head in tags.items() if name != str(ref)):
        return []
    out = []
    for name, head in tags.items():
        if name != str(ref) and any(link.digest == digest for link in store.chain(head, name)):
            out.append(name)
    return sorted(out)


def remove(store: Store, ref: str, cascade: bool = False,
           refuse: Callable[[str], None] | None = None) -> list[str]:
    """Remove tag ``ref`` (with ``cascade``, the tags built on it too). ``refuse`` is called
    with each tag to remove, under the tags' lock, and raises to keep them all: what it
    checks cannot change between its check and the removal (a tag set meanwhile, by a
    pause saving a sandbox's state onto the layer, is seen by it)."""
    key = parse_ref(ref)
    store.resolve(key)
    gone: list[str] = []

    def change(tags: dict[str, str]) -> None:
        if str(key) not in tags:
            raise NotFound(f"no tag {key} (removed meanwhile); `forkd images` lists them")
        deps = dependents(store, key, tags)
        if deps and not cascade:
            raise Conflict(
                f"{key} is the parent of {', '.join(deps)}; remove those first or pass "
                "--cascade"
            )
        for name in [str(key), *deps]:
            if refuse is not None:
                refuse(name)
            gone.append(name)
        for name in gone:
            tags.pop(name, None)

    store.tags.update(change)
    return gone
