"""Server-side compaction: a flat tag made on the hub from the blobs it already holds.

``POST /api/v1/compact/<name>`` with ``{"tag", "to", "force"}`` flattens the chain
that ``tag`` heads into one flat layer tagged ``to``. Nothing is uploaded: the core's
compaction (``forkd.store.store.Store.compact_digest``) runs on a scratch store whose
blobs are the hub's own blob store, so unchanged 2 MiB regions reuse the chunks the
hub has and only the regions the diffs changed become new chunks. The new manifest
carries ``dev.forkd.compacted.from: NAME:TAG@DIGEST`` (the lineage API shows it) and is
registered exactly like a manifest ``PUT`` (``register_manifest``), then tagged and
audited (``manifest.compact``).

The retention rule (setting ``compact_deeper_than``, 0 = off) compacts a tag pushed with
a chain deeper than the limit into ``TAG-flat``, in a background worker started with the
app (one job at a time, off the request path).

What a compaction may read is the caller's repository: the chain is walked through the
repository's manifest rows (their ``subject``), and a layer outside it is refused with
the same 400 whether that digest exists elsewhere on the hub or nowhere, so the answer
tells nothing about other repositories. Everything a chain's manifests reference was
linked into the repository when they were pushed; a blob of it missing from the store
is the hub's fault: logged with its digest, answered with a 500 that names none.
Compaction's work follows the chunks the chain stores, not the image size its maps
declare (``Store.compact_digest``).

Layout: ``DATA/.compact-*/`` is the scratch store of a running compaction (assembled
images, sparse), removed when it ends. The scratch store reads and writes blobs through
the ``BlobStore`` protocol, so compaction works on every blob backend (filesystem, S3).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar

import anyio
from anyio.abc import TaskStatus
from litestar import Controller, post
from litestar.di import NamedDependency
from litestar.exceptions import ValidationException
from litestar.params import FromPath, JSONBody
from sqlalchemy import select

from forkd import digest as dg
from forkd.audit import Actor
from forkd.bodies import Body
from forkd.errors import ChainError, Conflict, ForkdError, IntegrityError, InvalidInput
from forkd.hub import accounts
from forkd.hub.auth import (
    Caller,
    authenticate,
    authorize,
    client_ip,
    still_allowed,
    still_permitted,
)
from forkd.hub.errors import Code, RegistryError
from forkd.hub.models import Manifest, Tag
from forkd.hub.oci import common
from forkd.hub.oci.common import HubRequest, link_blob
from forkd.hub.oci.manifests import parse_manifest, register_manifest
from forkd.hub.services import Hub
from forkd.names import validate_name, validate_tag
from forkd.pack import mediatypes as mt
from forkd.pack.chain import MAX_CHAIN_DEPTH, walk
from forkd.pack.config import Provenance
from forkd.pack.manifest import MAX_MANIFEST_BYTES
from forkd.pack.manifest import Manifest as PackManifest
from forkd.store.blobs import BlobStore
from forkd.store.store import Store

log = logging.getLogger("forkd.hub.compaction")

FLAT_SUFFIX = "-flat"
RETENTION_ACTOR = "(retention)"  # not a valid user name: cannot be mistaken for one
# The retention rule's jobs waiting: in all, and of one namespace (an account's pushes
# queue no more than this many, so one account cannot fill the queue for the others).
QUEUE_MAX = 1000
QUEUE_PER_NAMESPACE = 50
# The most bytes a compaction writes into one assembled image (the pages the chain's chunks
# provide: holes are free). Chunks decompress up to 2 MiB from a few dozen bytes, so the
# chain's stored size does not bound this. 16x a 1 GiB guest's memory.
MAX_WRITTEN = 16 << 30
BUSY_RETRY_AFTER_S = 10  # Retry-After of a compaction refused because compactions_max run


class CompactRequest(Body):
    tag: str  # the chain head to flatten
    to: str  # the new tag (same repository)
    force: bool = False  # replace ``to`` if it exists


@dataclass
class CompactionResult:
    repository: str
    tag: str  # the new tag
    digest: str  # its manifest
    depth: int  # 0: flat
    memory_size: int
    stored_bytes: int  # blobs the new manifest references (config, maps, chunks, files)
    new_blobs: int  # of those, blobs the source chain did not have (written by the hub)
    new_bytes: int
    compacted_from: Provenance  # from_tag (NAME:TAG), from_digest, from_depth, reason


@dataclass
class _Flat:
    """What the thread hands back: the new manifest and its blobs."""

    digest: str
    body: bytes
    blobs: list[tuple[str, int]]
    memory_size: int
    provenance: Provenance
    new_blobs: int
    new_bytes: int


class _Vanished(Exception):
    """A GC sweep removed a blob between the compaction writing it and its registration."""


T = TypeVar("T")


class _Stopped(Exception):
    """Raised in the compaction's thread by ``_Watched`` once its caller lost push."""


class _Watched:
    """The hub's blob store as a compaction's thread sees it: each call first asks
    whether the compaction was stopped (``stop``, set by ``_Watch``) and raises
    ``_Stopped`` if so. The work is a sequence of blob reads and writes (chunks of at
    most 2 MiB), so it ends within one of them once its caller's right is gone."""

    def __init__(self, blobs: BlobStore, stop: threading.Event) -> None:
        self._blobs, self._stop = blobs, stop

    def _go_on(self) -> BlobStore:
        if self._stop.is_set():
            raise _Stopped
        return self._blobs

    def has(self, digest: str) -> bool:
        return self._go_on().has(digest)

    def size(self, digest: str) -> int:
        return self._go_on().size(digest)

    def put_bytes(self, data: bytes, expected: str | None = None) -> str:
        return self._go_on().put_bytes(data, expected)

    def put_stream(
        self, chunks: Iterable[bytes], expected: str | None = None, expected_size: int | None = None
    ) -> str:
        return self._go_on().put_stream(self._checked(chunks), expected, expected_size)

    def _checked(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self._go_on()
            yield chunk

    def read(self, digest: str, max_size: int, what: str = "blob") -> bytes:
        return self._go_on().read(digest, max_size, what)

    def delete(self, digest: str) -> None:
        self._go_on().delete(digest)

    def digests(self) -> Iterator[str]:
        return self._go_on().digests()

    def open(self, digest: str) -> BinaryIO:
        return self._go_on().open(digest)

    def mtime(self, digest: str) -> float:
        return self._go_on().mtime(digest)


class _Watch:
    """A request's compaction while its thread works: every ``RIGHTS_RECHECK_S`` its
    caller's push is asked again (``auth.still_allowed``, a short read each time); once it
    is gone the thread is stopped at its next blob call (``_Watched``) and ``run`` raises
    the refusal. Before, the check ran when the request began and when its result was
    registered: a member removed meanwhile had the hub write for minutes on their behalf."""

    OUTCOME = "the compaction was stopped and nothing of it was kept"

    def __init__(self, hub: Hub, caller: Caller, name: str) -> None:
        self.hub, self.caller, self.name = hub, caller, name
        self.stop = threading.Event()
        self.refusal: RegistryError | None = None

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(common.RIGHTS_RECHECK_S)
            try:
                await still_allowed(self.hub, self.caller, self.name, "push", self.OUTCOME)
            except RegistryError as exc:
                self.refusal = exc
                self.stop.set()
                return

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in a thread, watched; the refusal once push is gone."""
        outcome: list[T] = []
        failure: BaseException | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._watch)
            try:
                outcome.append(await anyio.to_thread.run_sync(work, *args))
            except Exception as exc:  # raised below, not in the task group's group
                failure = exc
            finally:
                tasks.cancel_scope.cancel()
        if self.refusal is not None:
            raise self.refusal
        if failure is not None:
            raise failure
        return outcome[0]


class _OutsideChain(ForkdError):
    """A manifest's ``subject`` disagrees with the database's row (a hub fault)."""


def _chain(store: Store, head: str, what: str, rows: list[str]) -> list[str]:
    """The chain read from the manifests themselves (head first), refusing what is no forkd
    pack; it may read only ``rows``, the chain the repository's rows gave."""
    allowed = frozenset(rows)

    def load(digest: str) -> PackManifest:
        if digest not in allowed:
            raise _OutsideChain(f"manifest subject {digest} is not the repository's row")
        return store.manifest(digest)

    chain = [link.digest for link in walk(head, load, MAX_CHAIN_DEPTH, what)]
    if chain != rows:
        raise _OutsideChain(f"the manifests' chain {chain} differs from the rows' {rows}")
    return chain


def _flatten(store: Store, head: str, chain: list[str], tag: str, provenance: Provenance) -> _Flat:
    """The CPU part (a thread): the core's compaction on the hub's blobs, nothing else."""
    old: set[str] = set(chain)
    for digest in chain:
        old.update(d.digest for d in store.manifest(digest).blobs())
    new = store.compact_digest(head, tag, provenance)
    body = store.blobs.read(new, MAX_MANIFEST_BYTES, "manifest")
    blobs = [(d.digest, d.size) for d in store.manifest(new).blobs()]
    fresh = [(d, size) for d, size in blobs if d not in old]
    return _Flat(
        new,
        body,
        blobs,
        store.config(new).memory_size,
        provenance,
        len(fresh),
        sum(size for _, size in fresh),
    )


def _as_registry_error(exc: ForkdError, what: str) -> RegistryError:
    """The answer for a failure on content of the caller's repository. What the hub's
    storage lacks (every blob of the chain was linked into the repository when pushed) or
    disagrees on is a server fault: logged with its details, answered without them."""
    if isinstance(exc, Conflict):
        return RegistryError(Code.DENIED, str(exc), status=409)
    if isinstance(exc, ChainError | InvalidInput | IntegrityError):
        return RegistryError(Code.MANIFEST_INVALID, f"{what} cannot be compacted: {exc}")
    log.error("compacting %s: the hub's storage fails the repository's content: %s", what, exc)
    return RegistryError(
        Code.MANIFEST_BLOB_UNKNOWN,
        f"{what} cannot be compacted: the hub cannot read content of this repository it "
        "should hold; this is the hub's fault, logged for its operator",
        status=500,
    )


async def compact_tag(
    hub: Hub,
    name: str,
    tag: str,
    to: str,
    *,
    force: bool = False,
    actor: Actor,
    ip: str = "-",
    reason: str = "manual",
    expect: str | None = None,
    deeper_than: int = -1,
    caller: Caller | None = None,
) -> CompactionResult | None:
    """Flatten ``name:tag`` into ``name:to`` on the hub. The caller checked push access.

    ``expect`` (a digest) and ``deeper_than`` serve the retention rule: it returns None,
    doing nothing, when the tag has moved on or its chain is not deeper than the limit.
    Raises RegistryError: 404 unknown tag, 409 existing ``to`` without ``force``.
    ``caller`` (a request's): checked again while the work runs (``_Watch``: stopped
    once push is gone) and when the result is registered (``auth.still_permitted``);
    None for the retention rule.
    """
    source = f"{name}:{tag}"
    async with hub.db.reading() as session:
        repo = await accounts.get_repository(session, name)
        if repo is None:
            raise RegistryError(Code.NAME_UNKNOWN, f"repository {name} not found")
        head_row = await session.get(Tag, (repo.id, tag))
        if head_row is None:
            raise RegistryError(Code.MANIFEST_UNKNOWN, f"tag {tag} not in {name}")
        head = head_row.manifest_digest
        if expect is not None and head != expect:
            return None  # pushed again meanwhile: that push queued its own job
        if not force and await session.get(Tag, (repo.id, to)) is not None:
            raise _conflict(name, to)
    watch = _Watch(hub, caller, name) if caller is not None else None

    async def in_thread(work: Callable[..., T], *args: Any) -> T:
        if watch is None:  # the retention rule's: the hub's own work
            return await anyio.to_thread.run_sync(work, *args)
        return await watch.run(work, *args)

    blobs: BlobStore = hub.blobs if watch is None else _Watched(hub.blobs, watch.stop)
    for _attempt in range(2):
        scratch = Path(tempfile.mkdtemp(dir=hub.settings.data_dir, prefix=".compact-"))
        try:
            store = Store(
                scratch,
                auto_compact_depth=MAX_CHAIN_DEPTH,
                blobs=blobs,
                max_written=MAX_WRITTEN,
            )
            rows = await _chain_in(hub, repo.id, name, source, head)
            try:
                chain = await in_thread(_chain, store, head, source, rows)
            except ForkdError as exc:
                raise _as_registry_error(exc, source) from exc
            if len(chain) - 1 <= deeper_than:
                return None
            provenance = Provenance(source, head, len(chain) - 1, reason)
            try:
                flat = await in_thread(_flatten, store, head, chain, f"{name}:{to}", provenance)
            except ForkdError as exc:
                raise _as_registry_error(exc, source) from exc
        except RegistryError as exc:
            if watch is not None and exc is watch.refusal:
                hub.audit.record(
                    actor, ip, "manifest.compact", f"{name}@{to}", "denied", reason=exc.detail
                )
            raise
        finally:
            with anyio.CancelScope(shield=True):  # also when the hub shuts down meanwhile
                await anyio.to_thread.run_sync(shutil.rmtree, scratch, True)
        try:
            await _register(hub, name, to, flat, force, caller)
        except _Vanished:
            log.warning("a gc sweep raced the compaction of %s; compacting again", source)
            continue
        hub.audit.record(
            actor,
            ip,
            "manifest.compact",
            f"{name}@{to}",
            "ok",
            digest=flat.digest,
            source=f"{tag}@{head}",
            reason=reason,
            new_blobs=flat.new_blobs,
            new_bytes=flat.new_bytes,
        )
        return CompactionResult(
            repository=name,
            tag=to,
            digest=flat.digest,
            depth=0,
            memory_size=flat.memory_size,
            stored_bytes=sum(size for _, size in flat.blobs),
            new_blobs=flat.new_blobs,
            new_bytes=flat.new_bytes,
            compacted_from=flat.provenance,
        )
    raise RegistryError(
        Code.MANIFEST_BLOB_UNKNOWN,
        f"gc sweeps kept removing the new blobs of {name}:{to}; compact again",
        status=503,
    )


def _conflict(name: str, to: str) -> RegistryError:
    return RegistryError(
        Code.DENIED, f"tag {to} exists in {name}; pick another tag or pass force", status=409
    )


async def _chain_in(hub: Hub, repo_id: int, name: str, source: str, head: str) -> list[str]:
    """The chain ``head`` heads (head first), walked through this repository's manifest
    rows. A pushed ``subject`` may name any digest: a layer that is not a manifest of this
    repository is refused before anything is read, with the same answer whether it
    exists elsewhere on the hub or nowhere."""
    chain: list[str] = []
    digest: str | None = head
    async with hub.db.reading() as session:
        while digest is not None:
            if digest in chain or len(chain) > MAX_CHAIN_DEPTH:
                raise RegistryError(
                    Code.MANIFEST_INVALID,
                    f"{source} cannot be compacted: its chain has a cycle or is deeper than "
                    f"the cap of {MAX_CHAIN_DEPTH} layers",
                )
            row = (
                await session.execute(
                    select(Manifest.subject_digest).where(
                        Manifest.repository_id == repo_id, Manifest.digest == digest
                    )
                )
            ).first()
            if row is None:
                raise RegistryError(
                    Code.MANIFEST_BLOB_UNKNOWN,
                    f"layer {digest} of the chain is not in {name}; push the whole chain first",
                )
            chain.append(digest)
            digest = row.subject_digest
    return chain


def _all_present(blobs: BlobStore, wanted: list[tuple[str, int]]) -> bool:
    """Whether the store holds every blob (a thread: a backend may ask over the network)."""
    return all(blobs.has(digest) for digest, _ in wanted)


async def _register(
    hub: Hub, name: str, to: str, flat: _Flat, force: bool, caller: Caller | None
) -> None:
    """Link the new blobs into the repository and register the manifest like a ``PUT``,
    if ``caller`` may still push there."""
    doc = parse_manifest(flat.body, mt.OCI_MANIFEST)
    async with hub.db.transaction() as session:
        await hub.db.lock_for_write(session)
        if caller is not None:
            await session.run_sync(still_permitted, caller, name, "push")
        repo = await accounts.get_repository(session, name)
        if repo is None:
            raise RegistryError(Code.NAME_UNKNOWN, f"repository {name} not found")
        # Before the links take the quota lock (the order of hub/db.py repository_lock).
        await hub.db.lock_repository(session, repo.id)
        if not force and await session.get(Tag, (repo.id, to)) is not None:
            raise _conflict(name, to)  # tagged meanwhile
        for digest, size in flat.blobs:
            await session.run_sync(link_blob, hub.db, repo.id, digest, size)
        # Under the write lock no sweep runs; one that ran before may have taken a blob.
        if not await anyio.to_thread.run_sync(_all_present, hub.blobs, flat.blobs):
            raise _Vanished
        await register_manifest(
            hub, session, repo, flat.body, mt.OCI_MANIFEST, doc, flat.digest, to
        )


# -- the route -----------------------------------------------------------------
def _checked(name: str, req: CompactRequest) -> str:
    try:
        name = validate_name(name.strip("/"))
        validate_tag(req.tag)
        validate_tag(req.to)
    except InvalidInput as exc:
        raise ValidationException(str(exc)) from exc
    return name


class CompactionController(Controller):
    path = "/api/v1/compact"
    tags: ClassVar[list[str]] = ["compaction"]  # type: ignore[misc]

    @post("/{name:path}", status_code=201)
    async def compact(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        name: FromPath[str],
        data: JSONBody[CompactRequest],
    ) -> CompactionResult:
        """Flatten ``tag``'s chain into a new flat tag ``to`` from the blobs the hub holds
        (nothing is uploaded); needs push. 409 when ``to`` exists and ``force`` is false."""
        name = _checked(name, data)
        caller = await authenticate(hub, request)
        await authorize(hub, request, caller, name, "push")
        # One compaction per account at a time: each may write 16 GiB and hold a core for
        # minutes, and without this one account's requests took every place. An account's
        # robots count as the account (``accounts.answerable_user``): one person makes
        # as many robots as it likes places.
        account = caller.principal.user_id
        if account is not None:
            account = await hub.db.read(accounts.answerable_user, account)
        if account is not None and account in hub.compacting:
            raise _busy_account()
        slots = hub.compactions.limiter()
        try:
            slots.acquire_nowait()
        except anyio.WouldBlock:
            raise _busy(slots.total_tokens) from None
        if account is not None:
            hub.compacting.add(account)
        try:
            result = await compact_tag(
                hub,
                name,
                data.tag,
                data.to,
                force=data.force,
                actor=caller.principal,
                ip=client_ip(request),
                caller=caller,
            )
        finally:
            slots.release()
            if account is not None:
                hub.compacting.discard(account)
        assert result is not None  # only the retention rule's conditions skip
        return result


def _busy(running: float) -> RegistryError:
    """All of ``compactions_max`` run: refused, not queued (a queue of requests each about
    to write up to 16 GiB would only move the stall)."""
    return RegistryError(
        Code.TOOMANYREQUESTS,
        f"the hub is running {int(running)} compaction(s), its limit (compactions_max); "
        f"nothing was done, retry in {BUSY_RETRY_AFTER_S} s",
        status=429,
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )


def _busy_account() -> RegistryError:
    """The caller runs a compaction already (one per account at a time)."""
    return RegistryError(
        Code.TOOMANYREQUESTS,
        "you are running a compaction on this hub already (one per account at a time); "
        f"nothing was done, retry in {BUSY_RETRY_AFTER_S} s",
        status=429,
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )


# -- the retention rule ----------------------------------------------------------
@dataclass(frozen=True)
class RetentionJob:
    name: str
    tag: str
    digest: str


class FairQueue:
    """The retention rule's waiting jobs, fair between namespaces: taken one namespace
    after the other in turn (each namespace's own in the order they came), at most
    ``per_namespace`` waiting for one namespace and ``total`` in all. A tag queued again
    replaces its waiting job (the older one would find the tag moved and do nothing), so
    pushing one tag over and over takes one place. When it is full, a namespace with
    fewer waiting takes the place of the newest job of the one with the most (an account
    administers up to 20 organisations: namespaces alone would not keep it from filling
    the queue). Used from the event loop only."""

    def __init__(self, total: int = QUEUE_MAX, per_namespace: int = QUEUE_PER_NAMESPACE):
        self.total, self.per_namespace = total, per_namespace
        self._waiting: dict[str, dict[tuple[str, str], RetentionJob]] = {}  # in turn order
        self._size = 0
        self._ready = anyio.Event()

    def __len__(self) -> int:
        return self._size

    def put(self, job: RetentionJob) -> str | None:
        """Queue ``job``; None, or why it was not queued."""
        namespace = accounts.namespace_of(job.name)
        mine = self._waiting.get(namespace, {})
        key = (job.name, job.tag)
        if key not in mine:
            if len(mine) >= self.per_namespace:
                return f"{self.per_namespace} jobs of namespace {namespace} wait already"
            if self._size >= self.total and not self._evict_for(len(mine)):
                return f"the queue is full ({self.total} jobs)"
            self._size += 1
        mine.pop(key, None)  # a replaced job goes to the back of its namespace's line
        mine[key] = job
        self._waiting[namespace] = mine
        self._ready.set()
        return None

    def _evict_for(self, waiting: int) -> bool:
        """The queue is full: drop the newest job of the namespace with the most waiting,
        if it has more than ``waiting`` (the newcomer's namespace's), so that however
        many namespaces one account fills, the others still get places. Whether one
        was dropped."""
        namespace, most = max(self._waiting.items(), key=lambda item: len(item[1]))
        if len(most) <= waiting:
            return False
        job = most.pop(next(reversed(most)))
        if not most:
            del self._waiting[namespace]
        self._size -= 1
        log.warning(
            "retention: queue full; %s:%s dropped for another namespace's", job.name, job.tag
        )
        return True

    async def get(self) -> RetentionJob:
        """The next job: the first of the namespace whose turn it is."""
        while not self._waiting:
            self._ready = anyio.Event()
            await self._ready.wait()
        namespace, mine = next(iter(self._waiting.items()))
        del self._waiting[namespace]
        job = mine.pop(next(iter(mine)))
        if mine:
            self._waiting[namespace] = mine  # its next job waits for the others' turns
        self._size -= 1
        return job


class Retention:
    """Compacts a tag pushed with a chain deeper than ``deeper_than`` into ``TAG-flat``.

    ``submit`` is a ``Hub.after_push`` hook: it only queues (``FairQueue``: one
    account's pushes cannot crowd out the others'). ``run`` (in the app's task group)
    takes one job at a time. ``TAG-flat`` belongs to the rule: it is replaced when the
    tag is pushed again. The pushed tag itself is never moved.
    """

    def __init__(self, hub: Hub, deeper_than: int) -> None:
        self.hub = hub
        self.deeper_than = deeper_than
        self.queue: FairQueue | None = None  # while ``run`` runs

    def submit(self, name: str, tag: str, digest: str, doc: dict[str, Any]) -> None:
        if doc.get("artifactType") != mt.ARTIFACT_TYPE or not doc.get("subject"):
            return  # not a forkd diff layer: nothing to flatten
        if len(tag) + len(FLAT_SUFFIX) > 128:
            log.warning("retention: %s:%s is too long a tag to add %s", name, tag, FLAT_SUFFIX)
            return
        if self.queue is None:
            log.warning("retention: worker not running; %s:%s not compacted", name, tag)
            return
        refused = self.queue.put(RetentionJob(name, tag, digest))
        if refused is not None:
            log.warning("retention: %s; %s:%s not compacted", refused, name, tag)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.queue = queue = FairQueue()
        task_status.started()
        try:
            while True:
                await self._one(await queue.get())
        finally:
            self.queue = None

    async def _one(self, job: RetentionJob) -> None:
        to = job.tag + FLAT_SUFFIX
        try:
            # One of the compactions_max places, waited for (one job at a time: the
            # queue is this worker's, never the requests').
            async with self.hub.compactions.limiter():
                result = await compact_tag(
                    self.hub,
                    job.name,
                    job.tag,
                    to,
                    force=True,
                    actor=RETENTION_ACTOR,
                    reason="auto-depth",
                    expect=job.digest,
                    deeper_than=self.deeper_than,
                )
        except RegistryError as exc:
            log.warning("retention: compacting %s:%s failed: %s", job.name, job.tag, exc)
            self.hub.audit.record(
                RETENTION_ACTOR,
                "-",
                "manifest.compact",
                f"{job.name}@{to}",
                "failed",
                source=f"{job.tag}@{job.digest}",
                reason=str(exc),
            )
        except Exception:  # a bug or a database outage: log it, keep serving
            log.exception("retention: compacting %s:%s failed", job.name, job.tag)
        else:
            if result is not None:
                log.info(
                    "retention: %s:%s (depth %d) compacted into %s %s",
                    job.name,
                    job.tag,
                    result.compacted_from.from_depth,
                    to,
                    dg.short(result.digest),
                )
